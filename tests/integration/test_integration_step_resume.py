"""The shared SFT/RM/DPO/KTO step loop (trainers/common.py) stopped mid-run and resumed
logs exactly the unbroken run's metrics, for each stage whose batches are built its own
way (pairs, ranked pairs as two KTO examples, a frozen reference). The real SIGKILL of the
same loop, in a subprocess, is tested once on SFT (tests/distributed/test_dist_resume.py);
here the kill is tests/faults.py's in-process stand-in.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from faults import Killed, kill_at, untimed

from rlhf_dist.config import config_from_dict
from rlhf_dist.distributed import seed_everything
from rlhf_dist.trainers import common
from rlhf_dist.trainers.dpo import train_dpo
from rlhf_dist.trainers.kto import train_kto
from rlhf_dist.trainers.reward import train_reward_model

TRAIN = {"rm": train_reward_model, "dpo": train_dpo, "kto": train_kto}


def train(stage: str, tree: dict, runtime) -> None:
    """One run as rlhf_dist.api runs it in-process: seeded first (the reward model's new
    value head is drawn from the RNG)."""
    seed_everything(tree["run"]["seed"])
    TRAIN[stage](config_from_dict(tree), runtime)


@pytest.mark.parametrize("stage", list(TRAIN))
def test_step_loop_stage_stopped_mid_run_resumes_to_the_same_metrics(
    stage, task_env, sft_run, runtime, tmp_path, monkeypatch, data_cfg, read_jsonl
):
    pairs = tmp_path / "pairs.jsonl"  # 96 pairs: 6 steps of 16 (KTO: 32 examples a step)
    pairs.write_text("".join(task_env.files.prefs_train.read_text().splitlines(True)[:96]))

    def tree(out: Path, **run) -> dict:
        return {
            "run": {"output_dir": str(out), "seed": 0, "log_every": 1, "checkpoint_every": 2}
            | run,
            "model": {"policy": str(sft_run.out / "final")},
            "data": data_cfg(train=str(pairs)),
            stage: {"batch_size": 32 if stage == "kto" else 16, "micro_batch_size": 8,
                    "optim": {"lr": 1e-3}},
        }  # fmt: skip

    unbroken = tmp_path / "unbroken"
    train(stage, tree(unbroken), runtime)
    expected = untimed(read_jsonl(unbroken / "metrics.jsonl"))
    assert [r["step"] for r in expected] == [1, 2, 3, 4, 5, 6]

    out = tmp_path / "killed"
    with monkeypatch.context() as mp:
        kill_at(mp, common, "update", 5)  # steps 1-4 checkpointed, step 5 lost
        with pytest.raises(Killed):
            train(stage, tree(out), runtime)
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-000004"
    train(stage, tree(out, resume="auto"), runtime)
    assert untimed(read_jsonl(out / "metrics.jsonl")) == expected  # bitwise, steps 1-6
