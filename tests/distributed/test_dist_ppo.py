"""PPO across 2 CPU ranks under DeepSpeed ZeRO-3, launched like a user would. SFT and RM
under ZeRO-3 (trained exports, the held-out pairs gathered from both ranks) are checked on
the ZeRO-3 launch of test_dist_engines.py, which runs every stage.

PPO with a critic and GRPO share ONE launch (scripts/run_stages.py: one process per rank
runs both stages in turn, each with a numerical guard of its own; a launch is ~10 s of
imports per rank), both with a NaN loss on rank 1 at their optimizer step 2."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import (
    REPO,
    engines,
    free_port,
    launch_args,
    ppo_command,
    run_launch,
    run_two_machines,
    shm_buffers,
)
from safetensors.torch import load_file


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def changed(before: dict, after: dict) -> bool:
    return any(not torch.equal(before[k], after[k]) for k in before)


RUN_STAGES = str(REPO / "tests" / "distributed" / "scripts" / "run_stages.py")
# GRPO with DAPO's dynamic sampling and a reward under which the groups of some prompts tie
GRPO = (
    "ppo.estimator=grpo", "ppo.rollout_batch_size=4", "ppo.samples_per_prompt=4",
    "reward.function=reward_fns_for_tests:ties_on_some_prompts",
    "ppo.dynamic_sampling=true", "ppo.dynamic_sampling_max_rounds=2",
)  # fmt: skip


@pytest.fixture(scope="module")
def zero3(assets, tmp_path_factory) -> tuple[Path, int]:
    """ONE 2-rank ZeRO-3 launch, RLHF_DIST_FAULT=nan:2@1: PPO with a critic and the update
    fetching layer by layer (ppo/), then GRPO (grpo/) -> (their root, the launch's port)."""
    root, port = tmp_path_factory.mktemp("zero3"), free_port()
    commands = [
        ppo_command(assets, root / "ppo", "perf.gather_for_training=never")[2:],
        ppo_command(assets, root / "grpo", *GRPO)[2:],
    ]
    path = os.pathsep.join([str(REPO), str(REPO / "tests" / "unit")])  # the reward's module
    env = {"RLHF_DIST_FAULT": "nan:2@1", "PYTHONPATH": path}
    # two stages in one launch: twice a single stage's time limit (a hang detector)
    run_launch(launch_args("cpu_zero3.yaml", port, RUN_STAGES, json.dumps(commands)), 480, env)
    return root, port


def test_ppo_zero3_two_ranks_trains_aggregates_and_skips_a_one_rank_nan(assets, zero3):
    """PPO with a critic under ZeRO-3, two micro-batches per rank per optimizer step, and
    a NaN loss on rank 1 at step 2 (the last of iteration 1): the skipped step's forwards
    leave ZeRO-3 prefetches in flight that only a backward would collect, and the next
    iteration's generation must not find them (guard.py, _release_zero3_params). The
    update fetches layer by layer here (perf.gather_for_training=never: the path
    of models whose full copy does not fit); every other ZeRO-3 run gathers it whole."""
    root, port = zero3
    out = root / "ppo"
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["guard/skipped_steps"] for r in rows] == [1, 1]
    for r in rows:
        # Each rank rolled out 8 prompts; the logged count is the sum over both ranks.
        assert r["rollout/sequences"] == 16
        assert r["rollout/length_min"] <= r["rollout/length"] <= r["rollout/length_max"]
    # The actor starts equal to the reference, so the first KL is ~0 on every rank.
    assert abs(rows[0]["objective/kl"]) < 1e-4
    before = load_file(str(Path(assets["policy"]) / "model.safetensors"))
    after = load_file(str(out / "final" / "model.safetensors"))
    assert before.keys() == after.keys()
    assert changed(before, after), "the actor's gathered weights did not change"
    rm_before = load_file(str(Path(assets["reward"]) / "model.safetensors"))
    critic_after = load_file(str(out / "critic" / "model.safetensors"))
    assert changed(rm_before, critic_after), "the critic did not train"
    # Each rank removed its DeepSpeed shared-memory allreduce buffer (backend.py).
    assert shm_buffers(port) == []


def test_grpo_zero3_two_ranks_builds_no_critic_trains_and_skips_a_one_rank_nan(assets, zero3):
    """GRPO under ZeRO-3, and the numerical guard in the same launch: optimizer step 2 (of
    4, two per iteration, two micro-batches per rank each: the poisoned step's second
    forward still runs) has a NaN loss on rank 1 only, and both ranks must skip it
    (docs/architecture.md section 7). Also DAPO's dynamic sampling with a reward under
    which the groups of some prompts tie: the ranks may drop different numbers of groups,
    yet run the same extra rounds (or ZeRO-3's collectives would hang) and each trains on
    a full batch."""
    out = zero3[0] / "grpo"
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["guard/skipped_steps"] for r in rows] == [1, 1]
    for r in rows:
        assert r["rollout/sequences"] == 16  # 2 ranks x 2 prompts x 4 samples
        rounds = r["rollout/dynamic_sampling_rounds"]
        # groups sampled, summed over both ranks: 2 ranks x 2 prompts per round
        assert r["rollout/dynamic_sampling_groups"] == 4 * (rounds + 1)
        dropped = r["rollout/dynamic_sampling_drop_rate"] * r["rollout/dynamic_sampling_groups"]
        assert abs(dropped - round(dropped)) < 1e-9
        assert 0 <= r["rollout/dynamic_sampling_filled"] <= 1
        assert "value/explained_variance" not in r and "optim/grad_norm_critic" not in r
    assert any(r["rollout/dynamic_sampling_drop_rate"] > 0 for r in rows)
    before = load_file(str(Path(assets["policy"]) / "model.safetensors"))
    after = load_file(str(out / "final" / "model.safetensors"))
    assert before.keys() == after.keys()
    assert changed(before, after), "the actor's gathered weights did not change"
    assert all(torch.isfinite(t).all() for t in after.values())
    assert not (out / "critic").exists()


@pytest.mark.parametrize("engine", engines())
def test_lora_ppo_on_two_machines_on_localhost(assets, engine, tmp_path):
    """The multi-node path (two 'machines' on 127.0.0.1, one rank each) with LoRA actor and
    critic under `engine` (FSDP2 opt-in: docs/distributed.md "Which 2-rank tests run under
    both engines"): one launch for both (each needs only one iteration)."""
    out = tmp_path / "lora2m"
    command = ppo_command(
        assets, out, "ppo.iterations=1", "lora.enabled=true", "lora.critic=true", "lora.r=4"
    )
    run_two_machines(engine, command)
    assert [r["step"] for r in metrics(out)] == [1]
    assert (out / "final" / "model.safetensors").exists()
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(assets["policy"])
    adapted = PeftModel.from_pretrained(base, str(out / "final_adapter"))
    merged = AutoModelForCausalLM.from_pretrained(str(out / "final"))
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(
            adapted(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-5, rtol=1e-4
        )
    assert abs(metrics(out)[0]["objective/kl"]) < 1e-4  # adapters start at zero: actor == reference
