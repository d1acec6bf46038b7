"""Reward failures lose nothing (docs/architecture.md section 7), through the CLI.

A reward function that goes down on its 3rd call ends the run with exit 2 and one line
naming --resume auto, after checkpointing iteration 2; the resumed run then logs bitwise
the metrics of a run that never failed. A failure that a retry (or a timeout and a retry)
gets past changes nothing. A failure on the very first call leaves no run directory.
One rollout micro-batch per iteration, so call k is iteration k's (when none is retried).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).parent
# Logged figures of wall-clock time, throughput and memory differ between any two runs.
UNTIMED = ("time/", "throughput/", "memory/")


def ppo(task_env, out: Path, env: dict, *extra: str) -> subprocess.CompletedProcess:
    args = [
        f"model.policy={task_env.policy}",
        f"data.train={task_env.prompts}",
        "data.max_prompt_length=16",
        "data.max_length=48",
        f"run.output_dir={out}",
        "perf.num_threads=1",
        "reward.function=flaky_rewards:flaky",
        "reward.retries=1",
        "reward.retry_delay_s=0",
        "ppo.critic_init=policy",
        "ppo.iterations=4",
        "ppo.rollout_batch_size=8",
        "ppo.rollout_micro_batch_size=8",
        "ppo.minibatch_size=4",
        "ppo.micro_batch_size=2",
        "ppo.ppo_epochs=1",
        "generation.max_new_tokens=6",
        *extra,
    ]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FLAKY_")}
    full_env |= {"PYTHONPATH": f"{REPO}{os.pathsep}{HERE}", "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(
        [sys.executable, "-m", "rlhf_dist", "ppo", *args],
        cwd=REPO, env=full_env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def metrics(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(UNTIMED)} for r in rows]


@pytest.fixture(scope="module")
def unbroken(task_env, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("unbroken") / "run"
    proc = ppo(task_env, out, {})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    return rows


@pytest.mark.slow
def test_reward_down_at_call_3_checkpoints_and_resume_matches_an_unbroken_run(
    task_env, tmp_path, unbroken
):
    out = tmp_path / "run"
    failed = ppo(task_env, out, {"FLAKY_DOWN_FROM": "3"})
    assert failed.returncode == 2, failed.stderr[-3000:]
    lines = [line for line in failed.stderr.splitlines() if line.startswith("rlhf-dist")]
    assert len(lines) == 1 and "Traceback" not in failed.stderr, failed.stderr[-3000:]
    for words in ("flaky_rewards:flaky", "reward server down", "--resume auto", "iteration 2"):
        assert words in lines[0], lines[0]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-000002"
    assert metrics(out) == unbroken[:2]

    resumed = ppo(task_env, out, {}, "run.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert metrics(out) == unbroken  # bitwise: the same floats, iterations 1-4
    assert (out / "final" / "model.safetensors").is_file()


@pytest.mark.slow
def test_a_failure_a_retry_gets_past_changes_nothing(task_env, tmp_path, unbroken):
    """Call 2 raises once and call 4 hangs past reward.timeout_s: each is retried (calls 3
    and 5 answer) and the run logs what the unbroken run logged."""
    out = tmp_path / "run"
    env = {"FLAKY_FAIL_CALLS": "2", "FLAKY_HANG_CALLS": "4", "FLAKY_HANG_S": "8"}
    proc = ppo(task_env, out, env, "reward.timeout_s=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "reward server hiccup (call 2); retrying" in proc.stderr
    assert "timed out: no answer within reward.timeout_s=1 s; retrying" in proc.stderr
    assert metrics(out) == unbroken
    assert not (out / "checkpoints").exists()


def test_a_reward_failure_on_the_first_call_leaves_no_run_directory(task_env, tmp_path):
    out = tmp_path / "run"
    proc = ppo(task_env, out, {"FLAKY_DOWN_FROM": "1"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("rlhf-dist")]
    assert len(lines) == 1 and "after 2 attempts" in lines[0], proc.stderr[-3000:]
    assert not out.exists(), sorted(p.name for p in out.iterdir())
