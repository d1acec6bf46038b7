"""`rlhf-dist iterate` end to end on the smallest sizes, through the CLI: two rounds, killed
in round 2's PPO (SIGKILL at its iteration-2 rollout), refused a restart without --resume,
resumed with --resume auto at that stage, and finished (docs/iterate.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def iterate(sft_run, task_env, out: Path, *extra: str, env=None) -> subprocess.CompletedProcess:
    args = [
        f"model.policy={sft_run.out / 'final'}",
        f"data.train={task_env.files.prompts}",
        f"data.eval={task_env.files.eval_prompts}",
        "data.max_prompt_length=16",
        "data.max_length=48",
        f"run.output_dir={out}",
        "perf.num_threads=1",
        "run.checkpoint_every=1",
        "eval.gold_function=rlhf_dist.demo.task:gold_reward_eval",
        "eval.num_prompts=8",
        "eval.batch_size=8",
        "iterate.rounds=2",
        "iterate.pairs_per_round=16",
        "iterate.heldout_pairs=8",
        "rm.batch_size=8",
        "rm.micro_batch_size=8",
        "ppo.iterations=2",
        "ppo.rollout_batch_size=8",
        "ppo.rollout_micro_batch_size=8",
        "ppo.minibatch_size=8",
        "ppo.micro_batch_size=8",
        "ppo.ppo_epochs=1",
        "generation.max_new_tokens=24",
        *extra,
    ]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("RLHF_DIST_FAULT")}
    full_env |= {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "rlhf_dist", "iterate", *args],
        cwd=REPO, env=full_env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip


@pytest.mark.slow
def test_iterate_two_rounds_killed_in_round_2_resumes_and_finishes(sft_run, task_env, tmp_path):
    out = tmp_path / "it"
    fault = {"RLHF_DIST_FAULT": "rollout:2", "RLHF_DIST_FAULT_ROUND": "2"}
    killed = iterate(sft_run, task_env, out, env=fault)
    assert killed.returncode == -signal.SIGKILL, (killed.stdout + killed.stderr)[-3000:]
    state = json.loads((out / "iterate_state.json").read_text())
    assert state["rounds"]["1"]["stages"] == ["samples", "rm", "ppo", "eval"]
    assert state["rounds"]["2"]["stages"] == ["samples", "rm"]
    assert (out / "round-2" / "ppo" / "checkpoints" / "latest").read_text().strip() == "step-000001"
    rm1 = out / "round-1" / "rm" / "final" / "model.safetensors"
    rm1_written = rm1.stat().st_mtime_ns

    refused = iterate(sft_run, task_env, out)
    assert refused.returncode == 2 and "--resume auto" in refused.stderr, refused.stderr[-2000:]

    resumed = iterate(sft_run, task_env, out, "--resume", "auto")
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert "resuming round 2 after samples, rm" in resumed.stdout
    assert "ppo: resuming from" in resumed.stdout
    assert rm1.stat().st_mtime_ns == rm1_written  # finished stages are not run again
    ppo2 = [json.loads(line) for line in (out / "round-2" / "ppo" / "metrics.jsonl").open()]
    assert [r["step"] for r in ppo2] == [1, 2]

    summary = json.loads((out / "summary.json").read_text())
    rounds = summary["rounds"]
    assert [r["round"] for r in rounds] == [1, 2]
    for r in rounds:
        assert 0 <= r["gold_reward"] <= 1 and 0 <= r["rm_accuracy_on_this_policy"] <= 1
        assert r["new_pairs"] > 0 and r["heldout_pairs"] > 0
    assert "rm_accuracy_on_previous_policy" not in rounds[0]
    assert 0 <= rounds[1]["rm_accuracy_on_previous_policy"] <= 1
    # Round 2's reward model trained on both rounds' pairs.
    assert rounds[1]["rm_train_pairs"] == rounds[0]["new_pairs"] + rounds[1]["new_pairs"]
    for k in (1, 2):
        r = out / f"round-{k}"
        for path in ("samples/pairs.jsonl", "samples/train.jsonl", "rm/final/config.json",
                     "ppo/final/config.json", "heldout/pairs.jsonl", "eval/summary.json"):  # fmt: skip
            assert (r / path).is_file(), (k, path)
    rows = [json.loads(line) for line in (out / "round-2" / "samples" / "train.jsonl").open()]
    assert {row["round"] for row in rows} == {1, 2}
    assert all({"prompt", "chosen", "rejected"} <= set(row) for row in rows)
