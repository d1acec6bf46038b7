"""Numerical guard: a NaN loss skips that optimizer step on every rank, is counted, and
K non-finite steps in a row stop the run with a checkpoint of the last good state.

RLHF_DIST_FAULT=nan:STEPS[@RANK] turns the loss of those optimizer steps into NaN (on one
rank only if RANK is given), as a bad batch or an exploding reward would. A NaN on one
rank under ZeRO-3, skipped on both, is checked in the 2-rank GRPO launch of
test_dist_ppo.py (one launch for both).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import torch
from conftest import REPO, _env
from safetensors.torch import load_file


def sft_args(assets, out: Path, *extra: str) -> list[str]:
    return [
        "sft", f"model.policy={assets['policy']}", f"data.train={assets['files'].sft}",
        f"run.output_dir={out}", "perf.num_threads=1", "sft.batch_size=32", "sft.micro_batch_size=8",
        "sft.optim.lr=1e-3", *extra,
    ]  # fmt: skip


def cli(args, fault):
    env = _env() | {"RLHF_DIST_FAULT": fault}
    return subprocess.run(
        [sys.executable, "-m", "rlhf_dist", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_one_nan_step_is_skipped_counted_and_training_goes_on(assets, tmp_path):
    out = tmp_path / "sft"
    proc = cli(sft_args(assets, out), "nan:3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    logged = rows(out)
    assert [r["guard/skipped_steps"] for r in logged] == [0, 0, 1, 1, 1, 1, 1, 1]
    assert logged[2]["sft/grad_norm"] is None  # the skipped step applied no gradient
    assert all(math.isfinite(r["sft/loss"]) for r in logged[3:])
    weights = load_file(str(out / "final" / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in weights.values())


def test_k_bad_steps_in_a_row_stop_with_the_last_good_state(assets, tmp_path):
    out = tmp_path / "sft"
    args = sft_args(
        assets, out, "run.checkpoint_every=1", "run.keep_checkpoints=10", "run.max_bad_steps=3"
    )
    proc = cli(args, "nan:3,4,5")
    assert proc.returncode == 3, proc.stderr[-3000:]
    message = [line for line in proc.stderr.splitlines() if line.startswith("rlhf-dist")]
    assert len(message) == 1 and "3 optimizer steps in a row" in message[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step-000005"
    good = torch.load(ckpts / "step-000002" / "training.pt", weights_only=True)
    last = torch.load(ckpts / "step-000005" / "training.pt", weights_only=True)
    for key in ("params", "exp_avg", "exp_avg_sq"):
        for name, value in good[key].items():
            assert torch.equal(value, last[key][name]), f"{key} {name} changed during skipped steps"
    assert not (out / "final").exists()
