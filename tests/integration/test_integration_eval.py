"""`run_eval` on the tiny demo task: KL to a reference, gold reward, samples.jsonl."""

from __future__ import annotations

import math

import pytest

from rlhf_dist.config import config_from_dict
from rlhf_dist.evaluate import run_eval


def eval_cfg(out, policy, reference, eval_prompts, data_cfg, **extra_eval):
    return config_from_dict(
        {
            "run": {"output_dir": str(out), "seed": 0},
            "model": {"policy": str(policy)},
            "data": data_cfg(train=str(eval_prompts)),
            "generation": {"max_new_tokens": 24, "temperature": 0.7},
            "reward": {"function": "rlhf_dist.demo.task:positive_word_reward"},
            # 16 prompts in chunks of 6: the last chunk is a partial one.
            "eval": {"reference": str(reference), "num_prompts": 16, "batch_size": 6, **extra_eval},
        }
    )


def test_eval_against_itself_has_zero_kl_and_reports_gold_reward(
    sft_run, task_env, runtime, tmp_path, data_cfg, read_jsonl
):
    policy = sft_run.out / "final"
    out = tmp_path / "eval_self"
    cfg = eval_cfg(
        out,
        policy,
        policy,
        task_env.files.eval_prompts,
        data_cfg,
        gold_function="rlhf_dist.demo.task:gold_reward_eval",
    )
    summary = run_eval(cfg, runtime)
    # The reference is the policy itself: log pi - log ref is exactly 0 on every token.
    assert abs(summary["kl_to_ref"]) < 1e-5
    assert 0.0 <= summary["gold_reward"] <= 1.0
    # The SFT policy writes well-formed reviews that end with EOS.
    assert summary["eos_rate"] > 0.5 and summary["length"] > 3
    assert -1.0 <= summary["score"] <= 1.0

    samples = read_jsonl(out / "samples.jsonl")
    assert len(samples) == 16
    assert all({"prompt", "response", "score"} <= s.keys() for s in samples)
    assert sum(s["score"] for s in samples) / 16 == pytest.approx(summary["score"], abs=1e-6)
    assert read_jsonl(out / "metrics.jsonl")[0]["eval/gold_reward"] == summary["gold_reward"]


def test_eval_kl_to_a_different_reference_is_positive(
    sft_run, task_env, runtime, tmp_path, data_cfg
):
    # Control for the test above: against the untrained random policy the same samples
    # have a large KL, so a zero there is not an artefact of how KL is computed.
    cfg = eval_cfg(
        tmp_path / "eval_other",
        sft_run.out / "final",
        task_env.policy,
        task_env.files.eval_prompts,
        data_cfg,
    )
    summary = run_eval(cfg, runtime)
    assert math.isfinite(summary["kl_to_ref"]) and summary["kl_to_ref"] > 1.0
    assert "gold_reward" not in summary
