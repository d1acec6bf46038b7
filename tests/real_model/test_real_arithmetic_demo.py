"""`rlhf-dist demo --task arithmetic` end to end at a tiny size: a random tiny Llama carrying
SmolLM2's real tokenizer and chat template stands in for the real model (the measured run:
docs/demo.md, "The arithmetic demo"), --quick's 2 GRPO iterations of 4 prompts x 4 samples
on reasoning-gym's chain_sum (8 new tokens: a random model never stops), the held-out
evaluation before and after.
"""

from __future__ import annotations

import json

import pytest

from rlhf_dist.demo import arithmetic_demo


@pytest.mark.slow  # ~40 CPU-seconds with the fixture's tiny models (measured on a loaded 2-core VM)
def test_the_arithmetic_demo_runs_end_to_end_and_writes_its_summary(
    tmp_path, tiny_real_vocab, capsys
):
    policy = tiny_real_vocab["shipped"]["policy"]
    summary = arithmetic_demo.run_arithmetic_demo(str(tmp_path), seed=0, quick=True, policy=policy)
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert summary["iterations"] == 2 and summary["seconds_per_iteration"] > 0
    # 16 held-out rows drawn (those the training rows hold left out: data/tasks.py's test)
    held = [json.loads(r) for r in _lines(tmp_path / "eval" / "base" / "samples.jsonl")]
    assert 0 < summary["held_out_prompts"] == len(held) <= 16
    assert all("State the final answer" in h["prompt"] for h in held)
    assert "min_digits=1&max_digits=1" in summary["task"] and "seed=100000" in summary["task"]
    for name in ("base", "grpo"):
        assert 0.0 <= summary[name]["accuracy"] <= 1.0
        scores = [
            json.loads(r)["score"] for r in _lines(tmp_path / "eval" / name / "samples.jsonl")
        ]
        assert abs(sum(scores) / len(scores) - summary[name]["accuracy"]) < 1e-6
    assert (tmp_path / "grpo" / "final" / "config.json").exists()
    out = capsys.readouterr().out
    assert "accuracy      base" in out and "->  GRPO" in out


def test_the_arithmetic_demo_runs_with_grpo_only(tmp_path, capsys):
    from rlhf_dist.cli import main

    argv = ["demo", "--task", "arithmetic", "--algorithm", "ppo", "--output-dir", str(tmp_path)]
    assert main(argv) == 2
    assert "--task arithmetic: runs with --algorithm grpo only" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def _lines(path):
    return path.read_text(encoding="utf-8").splitlines()
