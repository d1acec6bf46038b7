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


def test_a_nan_step_is_skipped_and_k_in_a_row_stop_with_the_last_good_state(assets, tmp_path):
    """One launch (each is ~10 s of imports): a NaN loss at step 3 is skipped and counted
    and training goes on at step 4; then steps 5, 6 and 7 in a row stop the run at step 7
    (run.max_bad_steps=3: the good step 4 reset the count, or it would stop at step 6)
    with exit 3, one line and a checkpoint of the last good state."""
    out = tmp_path / "sft"
    args = sft_args(
        assets, out, "run.checkpoint_every=1", "run.keep_checkpoints=10", "run.max_bad_steps=3"
    )
    proc = cli(args, "nan:3,5,6,7")
    assert proc.returncode == 3, proc.stderr[-3000:]
    message = [line for line in proc.stderr.splitlines() if line.startswith("rlhf-dist")]
    assert len(message) == 1 and "3 optimizer steps in a row" in message[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    logged = rows(out)
    assert [r["guard/skipped_steps"] for r in logged] == [0, 0, 1, 1, 2, 3, 4]
    assert logged[2]["sft/grad_norm"] is None  # the skipped step applied no gradient
    assert logged[3]["sft/grad_norm"] is not None and math.isfinite(logged[3]["sft/loss"])
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step-000007"

    def state(step: int) -> dict:
        return torch.load(ckpts / f"step-{step:06d}" / "training.pt", weights_only=True)

    same_keys = ("params", "exp_avg", "exp_avg_sq")

    def same(a: dict, b: dict) -> bool:
        return all(torch.equal(v, b[k][name]) for k in same_keys for name, v in a[k].items())

    before_nan, after_nan, good, last = state(2), state(3), state(4), state(7)
    assert same(before_nan, after_nan), "the weights or moments changed in skipped step 3"
    assert not same(after_nan, good), "training did not go on after the skipped step"
    # no NaN reached the weights or the moments through the skipped step
    assert all(torch.isfinite(t).all() for key in same_keys for t in good[key].values())
    assert same(good, last), "the weights or moments changed during skipped steps 5-7"
    assert not (out / "final").exists()
