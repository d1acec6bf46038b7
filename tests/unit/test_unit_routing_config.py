"""ppo.routing_replay (docs/moe.md, "Routing replay"): what the config refuses, each one line
naming the key (config/validation.py); r2 and r3 keep the actor's scoring forward."""

import pytest

from rlhf_dist.config import config_from_dict, validate
from rlhf_dist.config.sizes import old_logprobs_from_update
from rlhf_dist.errors import ConfigError

SERVER = {"backend": "server", "server_urls": ["http://127.0.0.1:1"]}


def _tree(generation=None, model=None, **ppo):
    return {
        "model": {"policy": "p"} | (model or {}),
        "data": {"train": "t.jsonl"},
        "reward": {"function": "m:f"},
        "generation": generation or {},
        "ppo": {"estimator": "grpo", "samples_per_prompt": 2} | ppo,
    }


@pytest.mark.parametrize(
    "tree, message",
    [
        (_tree({"backend": "vllm"}, routing_replay="r3"), r"^ppo.routing_replay: r3 .* vllm"),
        (_tree(model={"gradient_checkpointing": True}, routing_replay="r2"),
         r"^ppo.routing_replay: model.gradient_checkpointing"),
        (_tree(routing_replay="r2", dynamic_sampling=True), r"^ppo.routing_replay: ppo.dynamic"),
        (_tree(routing_replay="r2", estimator="online_dpo"), r"^ppo.routing_replay: ppo.estimator"),
        (_tree(SERVER, routing_replay="r3", max_staleness=1), r"^ppo.routing_replay: r3 with"),
        (_tree(routing_replay="r4"), r"ppo.routing_replay"),
    ],
)  # fmt: skip
def test_each_bad_combination_is_one_line_naming_the_key(tree, message):
    with pytest.raises(ConfigError, match=message) as e:
        validate(config_from_dict(tree), "ppo", inputs=False)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("generation", [None, SERVER])
def test_r2_and_r3_keep_the_scoring_forward_that_records_or_replays(generation):
    one_step = {"ppo_epochs": 1, "minibatch_size": 0, "kl_placement": "loss"}
    assert old_logprobs_from_update(config_from_dict(_tree(generation, **one_step)))
    for mode in ("r2", "r3"):
        cfg = config_from_dict(_tree(generation, routing_replay=mode, **one_step))
        validate(cfg, "ppo", inputs=False)
        assert not old_logprobs_from_update(cfg)
