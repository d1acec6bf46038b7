"""The end-to-end demo (`rlhf-dist demo --quick`): SFT -> RM -> PPO -> eval in one call."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rlhf_dist.demo.pipeline import run_demo


# ~10 s on 2 idle cores, minutes on a loaded machine (quick mode shortens PPO and eval
# only; SFT and RM run their full 186 steps each).
@pytest.mark.slow
def test_quick_demo_runs_end_to_end_and_writes_its_summary(tmp_path, runtime):
    # run_demo builds its own Runtime (the session's `runtime` fixture exists first, so
    # accelerate's singleton state is already set up) and sets torch's thread count to all
    # cores; restore the session's setting so later tests run as configured.
    threads = torch.get_num_threads()
    try:
        returned = run_demo(str(tmp_path), seed=0, quick=True)
    finally:
        torch.set_num_threads(threads)

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary == returned
    for dotted in (
        "sft.gold_reward",
        "ppo.gold_reward",
        "ppo.kl_to_ref",
        "rm.eval_accuracy",
        "rm.bayes_accuracy",
    ):
        section, key = dotted.split(".")
        assert math.isfinite(summary[section][key]), dotted
    assert summary["wall_seconds"] > 0
    assert 0 <= summary["sft"]["gold_reward"] <= 1 and 0 <= summary["ppo"]["gold_reward"] <= 1
    # The SFT policy is its own reference in the demo's evaluation.
    assert abs(summary["sft"]["kl_to_ref"]) < 1e-5
    assert summary["ppo"]["kl_to_ref"] > 0.0
    # Noisy labels cap the reward model below the Bayes-optimal accuracy (~0.87); chance is 0.5.
    assert 0.6 < summary["rm"]["eval_accuracy"] <= 1.0
    # Even the quick run improves the true (gold) reward clearly (seen: 0.53 -> 0.90).
    assert summary["ppo"]["gold_reward"] > summary["sft"]["gold_reward"] + 0.1
    for stage in ("sft", "rm", "ppo"):
        assert (tmp_path / stage / "final" / "config.json").is_file(), stage
    assert (tmp_path / "eval" / "ppo" / "samples.jsonl").is_file()
