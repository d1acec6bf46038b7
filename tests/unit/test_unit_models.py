"""Unit tests of the model-free helpers of rlhf_dist.models."""

from types import SimpleNamespace

from rlhf_dist.models import frozen_dtype, sub_state_dict


def test_sub_state_dict_keeps_one_submodule_and_drops_its_prefix():
    state = {
        "actor.lm_head.weight": 1,
        "actor.model.embed.weight": 2,
        "critic.classifier.score.weight": 3,
        "actorish.weight": 4,  # a sibling whose name merely starts the same way
    }
    assert sub_state_dict(state, "actor.") == {"lm_head.weight": 1, "model.embed.weight": 2}
    assert sub_state_dict(state, "critic.classifier.") == {"score.weight": 3}
    assert sub_state_dict(state, "") == state
    assert sub_state_dict(state, "reward.") == {}


def test_frozen_dtype_auto_follows_the_training_dtype():
    assert frozen_dtype(SimpleNamespace(dtype="bfloat16", frozen_dtype="auto")) == "bfloat16"
    assert frozen_dtype(SimpleNamespace(dtype="bfloat16", frozen_dtype="float32")) == "float32"
