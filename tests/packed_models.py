"""model.packed_sequences switched on in a model built without a config (on the tests' path)."""

from transformers import PreTrainedModel


def packed(model):
    """`model` with packed_sequences on in every transformers model inside it (an LM, a
    ValueModel, an ActorCritic, peft-wrapped or not), as the loaders set it from
    model.packed_sequences; returns `model`."""
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            module.packed_sequences = True
    return model
