"""PPO on vLLM rollouts across 2 CPU ranks, one in-process engine per rank, launched like a
user would: under ZeRO-3 (weights gathered once per rollout and loaded into each rank's
engine) and with LoRA (adapters merged into the base for the sync). debug.check_vllm_sync
makes every rollout compare vLLM's greedy tokens with the actor's own after the sync, so a
sync that did not take fails the run (tests/integration/test_integration_vllm.py shows the
check catching a stale engine).

Skipped where vllm is not installed (launch/setup.sh installs it on CPU machines)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import free_port, launch_args, ppo_command, run_launch
from safetensors.torch import load_file

pytest.importorskip("vllm")


def vllm_ppo_command(assets, out: Path, *extra: str) -> list[str]:
    return ppo_command(
        assets, out, "generation.backend=vllm", "generation.vllm_kv_cache_gib=0.25",
        "debug.check_vllm_sync=true", *extra,
    )  # fmt: skip


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _check_rollouts(out: Path, proc) -> None:
    # A good run says nothing alarming: no traceback from vLLM's exit hook or its warm-up.
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2]  # both rollouts passed the sync check
    for r in rows:
        assert r["rollout/sequences"] == 16  # 2 ranks x 8 prompts, each on its own engine
        assert r["rollout/sampler_logprob_absdiff"] < 1e-4  # fp32: vLLM samples pi_old
    assert abs(rows[0]["objective/kl"]) < 1e-4  # the first rollout: actor == reference


def test_ppo_vllm_rollouts_under_zero3_two_ranks(assets, tmp_path):
    out = tmp_path / "z3"
    command = vllm_ppo_command(assets, out, "ppo.tis_cap=2.0")
    proc = run_launch(launch_args("cpu_zero3.yaml", free_port(), *command), timeout=180)
    _check_rollouts(out, proc)
    before = load_file(str(Path(assets["policy"]) / "model.safetensors"))
    after = load_file(str(out / "final" / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_ppo_vllm_rollouts_with_lora_two_ranks(assets, tmp_path):
    out = tmp_path / "lora"
    command = vllm_ppo_command(assets, out, "lora.enabled=true", "lora.r=4")
    proc = run_launch(launch_args("cpu_ddp.yaml", free_port(), *command), timeout=180)
    _check_rollouts(out, proc)
    assert (out / "final_adapter").exists()
