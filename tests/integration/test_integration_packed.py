"""perf.packed_sequences through a whole PPO run (docs/architecture.md section 10): the
actor's, reference's, critic's and reward model's forwards run on packed rows (several
sequences per row, no attention mask), generation stays padded with its KV cache, and the
run logs the same metrics as the padded run."""

from __future__ import annotations

import pytest
from packed_models import shared_rows

from rlhf_dist.config import config_from_dict
from rlhf_dist.engine import packing as engine_packing
from rlhf_dist.trainers import ppo

NOISY = ("time/", "throughput/", "memory/")


def gae_tree(out, task_env, data, packed: bool) -> dict:
    return {
        "run": {"output_dir": str(out), "seed": 0, "log_every": 1},
        "model": {
            "policy": str(task_env.policy),
            "reward": str(task_env.reward),
        },
        # The baseline is the whole-row padded forward, one per call as packed runs do
        # (shared prompts would split the actor's into two: test_unit_shared_prompt).
        "perf": {"packed_sequences": packed, "shared_prompt_forward": False},
        "data": data,
        "generation": {"max_new_tokens": 12, "temperature": 0.7},
        "ppo": {
            "iterations": 2, "rollout_batch_size": 8, "rollout_micro_batch_size": 8,
            "ppo_epochs": 1, "minibatch_size": 8, "micro_batch_size": 4,
            "optim": {"lr": 1e-3}, "critic_optim": {"lr": 1e-3}, "kl_coef": 0.05,
        },
    }  # fmt: skip


def run(tree, runtime, monkeypatch, read_jsonl):
    """metrics.jsonl rows and (token slots, real tokens, masked) of every whole-sequence
    forward."""
    forwards = []
    original = engine_packing.backbone_inputs

    def spy(input_ids, attention_mask, layout):
        inputs = original(input_ids, attention_mask, layout)
        real = int(attention_mask.sum())
        forwards.append((inputs["input_ids"].numel(), real, inputs["attention_mask"] is not None))
        return inputs

    with monkeypatch.context() as m:
        m.setattr(engine_packing, "backbone_inputs", spy)
        ppo.train_ppo(config_from_dict(tree), runtime)
    return read_jsonl(tree["run"]["output_dir"] + "/metrics.jsonl"), forwards


def test_ppo_with_packed_sequences_logs_the_padded_runs_metrics(
    task_env, runtime, tmp_path, monkeypatch, data_cfg, read_jsonl
):
    data = data_cfg(train=str(task_env.files.prompts))
    padded, padded_forwards = run(
        gae_tree(tmp_path / "padded", task_env, data, False), runtime, monkeypatch, read_jsonl
    )
    rows = shared_rows(monkeypatch)  # the demo's lengths are close: rows of 2 x the width
    packed, packed_forwards = run(
        gae_tree(tmp_path / "packed", task_env, data, True), runtime, monkeypatch, read_jsonl
    )
    # Actor, reference, critic and reward model in scoring, actor + critic in the update.
    assert len(packed_forwards) == len(padded_forwards) >= 8
    assert all(masked for *_, masked in padded_forwards)
    assert not any(masked for *_, masked in packed_forwards)
    assert [real for _, real, _ in packed_forwards] == [real for _, real, _ in padded_forwards]
    assert len(rows) == len(packed_forwards)
    assert sum(r for _, r in rows) < sum(b for b, _ in rows)  # sequences shared rows
    assert len(packed) == len(padded) == 2
    for a, b in zip(packed, padded):
        keys = [k for k in a if not k.startswith(NOISY)]
        assert keys == [k for k in b if not k.startswith(NOISY)]
        for k in keys:
            assert a[k] == pytest.approx(b[k], abs=1e-5, rel=1e-4), k
    assert packed[1]["value/loss"] > 0 and packed[1]["objective/kl"] != 0
