"""model.packed_sequences in tests (on the tests' path): switched on in a model built
without a config, and packed rows made to hold several sequences."""

from transformers import PreTrainedModel

from rlhf_dist import models
from rlhf_dist.algo.packing import packed_layout


def packed(model):
    """`model` with packed_sequences on in every transformers model inside it (an LM, a
    ValueModel, an ActorCritic, peft-wrapped or not), as the loaders set it from
    model.packed_sequences; returns `model`."""
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            module.packed_sequences = True
    return model


def shared_rows(monkeypatch) -> list[tuple[int, int]]:
    """Packed rows of twice the padded width for the test, so that sequences of similar
    lengths (the demo task's) share rows and attention must stay inside each; returns the
    (padded rows, packed rows) of every packed forward, filled as they run."""
    seen = []

    def wider(attention_mask, capacity):
        layout = packed_layout(attention_mask, 2 * capacity)
        seen.append((attention_mask.shape[0], layout[0].shape[0]))
        return layout

    monkeypatch.setattr(models, "packed_layout", wider)
    return seen
