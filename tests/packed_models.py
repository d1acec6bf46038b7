"""perf.packed_sequences in tests (on the tests' path): switched on in an ActorCritic
built for another run, and packed rows made to hold several sequences."""

import dataclasses

from rlhf_dist.algo.packing import packed_layout
from rlhf_dist.config import PerfConfig
from rlhf_dist.engine import packing as engine_packing
from rlhf_dist.models import ActorCritic, ValueModel

PACKED = PerfConfig(packed_sequences=True)  # the step functions' perf argument


def packed(model):
    """`model` (an ActorCritic or ValueModel, or a module holding them) with
    perf.packed_sequences on in each, as if built with it; returns `model`."""
    for module in model.modules():
        if isinstance(module, (ActorCritic, ValueModel)):
            module.perf = dataclasses.replace(module.perf, packed_sequences=True)
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

    monkeypatch.setattr(engine_packing, "packed_layout", wider)
    return seen
