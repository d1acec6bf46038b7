"""The demo's objective presets (`rlhf-dist demo --algorithm gspo|cispo|dapo`) are valid
PPO configs with GRPO's estimator and the keys docs/agents.md lists."""

from pathlib import Path

import pytest

from rlhf_dist.config import config_from_dict, validate
from rlhf_dist.demo import pipeline, task

WANT = {
    "gspo": {"ratio_level": "sequence", "loss_aggregation": "seq_mean_token_mean"},
    "cispo": {"policy_loss": "cispo", "clip_eps_low": 1.0, "clip_eps_high": 0.28},
    "dapo": {
        "clip_eps_high": 0.28,
        "loss_aggregation": "token_mean",
        "dynamic_sampling": True,
        "overlong": "soft",
    },
}


@pytest.mark.parametrize("algorithm", list(WANT))
def test_objective_preset_is_a_valid_grpo_config(algorithm, tmp_path):
    assert algorithm in pipeline.ALGORITHMS
    files = task.TaskFiles.at(tmp_path / "task")
    trees = pipeline.stage_configs(tmp_path, files, {"policy": Path("p")}, 0, False, algorithm)
    cfg = config_from_dict(trees[algorithm])
    validate(cfg, "ppo")
    assert cfg.ppo.estimator == "grpo" and cfg.ppo.samples_per_prompt == 4
    for key, value in WANT[algorithm].items():
        assert getattr(cfg.ppo, key) == value, key
    # the rest is GRPO's demo setting
    grpo = config_from_dict(
        pipeline.stage_configs(tmp_path, files, {"policy": Path("p")}, 0, False, "grpo")["grpo"]
    )
    assert cfg.ppo.optim == grpo.ppo.optim and cfg.ppo.kl_coef == grpo.ppo.kl_coef
