"""DPO, ORPO and KTO across 2 CPU ranks under DeepSpeed ZeRO-3, launched like a user would:
the three stages in ONE launch (scripts/run_stages.py, one process per rank running each
stage's command in turn; a launch is ~10 s of imports per rank), compared with one
process running DPO and ORPO."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ENGINES, REPO, _env, engines, free_port, launch_args, run_launch

RUN_COMMANDS = REPO / "tests" / "distributed" / "scripts" / "run_commands.py"
RUN_STAGES = str(REPO / "tests" / "distributed" / "scripts" / "run_stages.py")


def command(stage: str, assets, out: Path, *extra: str) -> list[str]:
    return [
        "-m", "rlhf_dist", stage,
        f"model.policy={assets['policy']}",
        f"data.train={assets['files'].prefs_train}",
        f"run.output_dir={out}",
        "run.log_every=1",
        "perf.num_threads=1",
        f"{stage}.batch_size=32",
        f"{stage}.micro_batch_size=4",
        f"{stage}.optim.lr=1e-3",
        *extra,
    ]  # fmt: skip


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def first_pairs(assets, path: Path, n: int) -> Path:
    path.write_text("".join(assets["files"].prefs_train.read_text().splitlines(True)[:n]))
    return path


def dpo_data(assets, root: Path) -> tuple[str, ...]:
    pairs = first_pairs(assets, root / "pairs64.jsonl", 64)  # 2 steps of 32 pairs
    return (f"data.train={pairs}", f"data.eval={assets['files'].prefs_eval}")


def orpo_extra(assets, root: Path) -> tuple[str, ...]:
    pairs = first_pairs(assets, root / "pairs128.jsonl", 128)  # 4 steps of 32 pairs
    return (
        f"data.train={pairs}", f"data.eval={assets['files'].prefs_eval}", "dpo.loss_type=orpo",
        "dpo.beta=0.5",
    )  # fmt: skip


def kto_extra(assets, root: Path) -> tuple[str, ...]:
    """KTO with LoRA and its reference online: 64 pairs -> 128 examples, 4 steps of 32
    (the launch's stages share DeepSpeed's batch settings: micro-batch 4, accumulation 4)."""
    pairs = first_pairs(assets, root / "kto_pairs64.jsonl", 64)
    return ("lora.enabled=true", "lora.r=4", "kto.reference_logprobs=online", f"data.train={pairs}")


@pytest.fixture(scope="module")
def zero3(assets, tmp_path_factory) -> Path:
    """ONE 2-rank ZeRO-3 launch running DPO with a partitioned reference (dpo/), ORPO
    (orpo/) and KTO with LoRA (kto/), one stage after another."""
    root = tmp_path_factory.mktemp("zero3")
    dpo = ("distributed.frozen_models=partition", *dpo_data(assets, root))
    commands = [
        command("dpo", assets, root / "dpo", *dpo)[2:],
        command("dpo", assets, root / "orpo", *orpo_extra(assets, root))[2:],
        command("kto", assets, root / "kto", *kto_extra(assets, root))[2:],
    ]
    launch = launch_args("cpu_zero3.yaml", free_port(), RUN_STAGES, json.dumps(commands))
    run_launch(launch, timeout=360)
    return root


@pytest.fixture(scope="module")
def one_process(assets, tmp_path_factory) -> Path:
    """The one-process runs the 2-rank DPO and ORPO launches are compared with (dpo/,
    orpo/), from ONE process: scripts/run_commands.py runs the CLI's main on each command
    in turn, each stage seeded afresh (a launch is ~10 s of imports)."""
    root = tmp_path_factory.mktemp("one_process")
    commands = [
        command("dpo", assets, root / "dpo", *dpo_data(assets, root))[2:],
        command("dpo", assets, root / "orpo", *orpo_extra(assets, root))[2:],
    ]
    proc = subprocess.run(
        [sys.executable, str(RUN_COMMANDS), json.dumps(commands)],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


def test_dpo_zero3_two_ranks_matches_one_process(zero3, one_process):
    """A partitioned reference scored in lock-step, then the same optimizer steps as one
    process with 8 micro-batches: losses and reward statistics agree to float rounding."""
    two = zero3 / "dpo"
    a, b = metrics(two), metrics(one_process / "dpo")
    steps = [r for r in a if "dpo/loss" in r]
    assert len(steps) == 2 and abs(steps[0]["dpo/loss"] - math.log(2)) < 1e-5
    for step, (x, y) in enumerate(zip(steps, [r for r in b if "dpo/loss" in r], strict=True)):
        # At step 1 the policy IS the reference: every margin is rounding noise around 0,
        # so which pairs count as "accurate" (margin > 0) is noise too.
        keys = ("dpo/loss", "rewards/margins", "logprobs/chosen")
        for key in keys + (("rewards/accuracy",) if step > 0 else ()):
            assert abs(x[key] - y[key]) < 1e-3 * max(1.0, abs(y[key])), (key, x[key], y[key])
    two_summary = json.loads((two / "summary.json").read_text())
    assert two_summary["eval_pairs"] == 64 and math.isfinite(two_summary["eval_accuracy"])
    assert (two / "final" / "model.safetensors").exists()


def test_orpo_zero3_two_ranks_matches_one_process(zero3, one_process):
    """Reference-free ORPO on 2 ZeRO-3 ranks (no reference table or model): the same
    steps as one process (its NLL a token sum over the chosen tokens of BOTH ranks), and
    the held-out evaluation scored in lock-step passes."""
    two, one = zero3 / "orpo", one_process / "orpo"
    a = [r for r in metrics(two) if "dpo/loss" in r]
    b = [r for r in metrics(one) if "dpo/loss" in r]
    assert len(a) == len(b) == 4
    for x, y in zip(a, b):
        for key in ("dpo/loss", "dpo/nll", "dpo/log_odds_ratio", "rewards/margins"):
            assert abs(x[key] - y[key]) < 1e-3 * max(1.0, abs(y[key])), (key, x[key], y[key])
    summaries = [json.loads((d / "summary.json").read_text()) for d in (two, one)]
    assert summaries[0]["eval_pairs"] == 64
    assert abs(summaries[0]["eval_loss"] - summaries[1]["eval_loss"]) < 1e-3
    assert not (two / "reference_logprobs.json").exists()


@pytest.mark.parametrize("engine", engines())  # FSDP2 opt-in (docs/distributed.md)
def test_kto_lora_two_ranks_online_reference(assets, engine, request, tmp_path):
    """Under ZeRO-3 the shared launch's KTO run; FSDP2 (opt-in) a launch of its own."""
    if engine == "zero3":
        out = request.getfixturevalue("zero3") / "kto"
    else:
        out = tmp_path / "kto"
        stage = command("kto", assets, out, *kto_extra(assets, tmp_path))
        run_launch(launch_args(ENGINES[engine], free_port(), *stage))
    rows = [r for r in metrics(out) if "kto/loss" in r]
    assert len(rows) == 4  # 64 pairs -> 128 examples / 32
    assert rows[0]["kto/kl"] == 0.0 and abs(rows[0]["kto/loss"] - 0.5) < 1e-5
    assert all(math.isfinite(r["kto/loss"]) and r["kto/kl"] >= 0 for r in rows)
    assert (out / "final_adapter" / "adapter_config.json").is_file()
    assert (out / "final" / "model.safetensors").is_file()
