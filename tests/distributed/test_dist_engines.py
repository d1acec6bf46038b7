"""FSDP2 and DeepSpeed ZeRO-3 train the same: at fp32, 2-rank runs of SFT, DPO and GRPO log
the same metrics to 1e-5 under either engine (issue 52, "Metrics match").

Which of the other 2-rank tests also run under FSDP2,
and why: docs/distributed.md "Choosing the engine".
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, _env, free_port, launch_args, run_all

ENGINES = {"zero3": "cpu_zero3.yaml", "fsdp2": "cpu_fsdp2.yaml"}
STAGES = ("sft", "dpo", "grpo")


def stage_commands(assets, root: Path) -> list[list[str]]:
    """Two optimizer steps of each stage on the tiny assets, fp32 (model.dtype default).
    Every stage has micro-batches of 2 and optimizer steps of 16 rows."""
    sft_rows = root / "sft32.jsonl"
    sft_rows.write_text("".join(assets["files"].sft.read_text().splitlines(True)[:32]))
    pairs = root / "pairs32.jsonl"
    pairs.write_text("".join(assets["files"].prefs_train.read_text().splitlines(True)[:32]))
    common = (f"model.policy={assets['policy']}", "perf.num_threads=1", "run.log_every=1")
    return [
        ["sft", *common, f"data.train={sft_rows}", f"run.output_dir={root / 'sft'}",
         "sft.batch_size=16", "sft.micro_batch_size=2", "sft.optim.lr=1e-3",
         "run.checkpoint_every=1"],
        ["dpo", *common, f"data.train={pairs}", f"run.output_dir={root / 'dpo'}",
         "dpo.batch_size=16", "dpo.micro_batch_size=2", "dpo.optim.lr=1e-3"],
        ["grpo", *common, f"data.train={assets['files'].prompts}",
         f"run.output_dir={root / 'grpo'}", "ppo.iterations=2", "ppo.rollout_batch_size=8",
         "ppo.samples_per_prompt=2", "ppo.minibatch_size=16", "ppo.micro_batch_size=2",
         "ppo.optim.lr=1e-3", "generation.max_new_tokens=8",
         "reward.function=rlhf_dist.demo.task:positive_word_reward"],
    ]  # fmt: skip


def rows(out: Path) -> list[dict]:
    """The metrics rows of a run, without what measures the machine rather than the run."""
    machine = ("time/", "throughput/", "memory/")
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [
        {k: v for k, v in json.loads(line).items() if not k.startswith(machine)} for line in lines
    ]


@pytest.fixture(scope="module")
def runs(assets, tmp_path_factory) -> dict[str, Path]:
    """engine -> the directory holding its sft/, dpo/ and grpo/ runs: one launch per stage
    and engine (a process runs one stage: it leaves the process group at the end), the
    two engines' launches of a stage at once, from an empty working directory."""
    roots = {engine: tmp_path_factory.mktemp(engine) for engine in ENGINES}
    commands = {engine: stage_commands(assets, roots[engine]) for engine in ENGINES}
    for i, stage in enumerate(STAGES):
        launches = [
            launch_args(config, free_port(), "-m", "rlhf_dist", *commands[engine][i])
            for engine, config in ENGINES.items()
        ]
        # From a directory of their own: the shipped configs work from anywhere (item 7).
        results = run_all(launches, 240, [{}, {}], cwd=tmp_path_factory.mktemp(stage))
        for engine, (code, out, err) in zip(ENGINES, results, strict=True):
            assert code == 0, f"{engine} {stage} exited {code}\n{(out + err)[-6000:]}"
    return roots


@pytest.mark.parametrize("stage", STAGES)
def test_fsdp2_metrics_equal_zero3_metrics(runs, stage):
    zero3, fsdp2 = rows(runs["zero3"] / stage), rows(runs["fsdp2"] / stage)
    assert len(zero3) == len(fsdp2) >= 2
    compared = 0
    for step, (a, b) in enumerate(zip(zero3, fsdp2, strict=True)):
        assert a.keys() == b.keys(), (step, a.keys() ^ b.keys())
        for key, x in a.items():
            y = b[key]
            if stage == "dpo" and step == 0 and key == "rewards/accuracy":
                continue  # the policy IS the reference: margins are rounding noise around 0
            if isinstance(x, float) and math.isfinite(x):
                assert abs(x - y) <= 1e-5 * max(1.0, abs(x)), (stage, step, key, x, y)
                compared += 1
            else:
                assert x == y or (x != x and y != y), (stage, step, key, x, y)
    assert compared >= 10
    assert (runs["fsdp2"] / stage / "final" / "model.safetensors").is_file()


def test_fsdp2_checkpoint_resumes_on_one_process_to_the_same_metrics(assets, runs, tmp_path):
    """The 2-rank FSDP2 SFT run's step-1 checkpoint (shards and Adam moments gathered),
    resumed by ONE plain process: its step 2 logs what the 2-rank run's step 2 did."""
    sft = runs["fsdp2"] / "sft"
    command = next(c for c in stage_commands(assets, tmp_path) if c[0] == "sft")
    resume = [*command, f"run.output_dir={tmp_path / 'resumed'}"]
    resume += ["--resume", str(sft / "checkpoints" / "step-000001")]
    proc = subprocess.run(
        [sys.executable, "-m", "rlhf_dist", *resume],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = {r["step"]: r for r in rows(tmp_path / "resumed")}
    two_ranks = {r["step"]: r for r in rows(sft)}
    assert 1 not in resumed and 2 in resumed
    for key in ("sft/loss", "sft/grad_norm"):
        x, y = two_ranks[2][key], resumed[2][key]
        assert abs(x - y) <= 1e-5 * max(1.0, abs(x)), (key, x, y)
