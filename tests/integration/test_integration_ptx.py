"""PPO-ptx on the demo task (rlhf_dist/trainers/ppo/ptx.py; docs/agents.md, "PPO-ptx").

- A run stopped half-way through an iteration and resumed logs exactly what the unbroken
  run logged, `policy/ptx_loss` included: the ptx stream's position is in the checkpoint.
- The issue's test: PPO raises the policy's NLL on held-out SFT rows; with ptx it rises
  less, at a similar gold reward.

The split invariance of the ptx term is in test_integration_ppo.py, beside PPO's own.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from faults import Killed, kill_at, untimed

from rlhf_dist.config import config_from_dict
from rlhf_dist.data.rows import load_rows, sft_examples
from rlhf_dist.demo import task
from rlhf_dist.models import load_causal_lm
from rlhf_dist.trainers import ppo
from rlhf_dist.trainers.ppo import update as ppo_update
from rlhf_dist.trainers.sft import eval_nll

GOLD = "rlhf_dist.demo.task:gold_reward_fn"


def metrics(out: Path) -> list[dict]:
    return untimed([json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()])


def test_ptx_killed_mid_update_resumes_to_the_same_metrics(
    sft_run, task_env, runtime, tmp_path, monkeypatch, data_cfg
):
    def tree(out: Path, **run) -> dict:
        return {
            "run": {"output_dir": str(out), "seed": 0, "log_every": 1, "checkpoint_every": 1} | run,
            "model": {"policy": str(sft_run.out / "final")},
            "data": data_cfg(train=str(task_env.files.prompts), ptx=str(task_env.files.sft)),
            "generation": {"max_new_tokens": 8, "temperature": 0.7},
            "reward": {"function": GOLD},
            "ppo": {
                "estimator": "grpo",
                "iterations": 3,
                "rollout_batch_size": 4,
                "samples_per_prompt": 2,
                "rollout_micro_batch_size": 8,
                "minibatch_size": 4,
                "micro_batch_size": 2,
                "ppo_epochs": 1,
                "optim": {"lr": 1e-3},
                "ptx_coef": 1.0,
            },
        }

    unbroken = tmp_path / "unbroken"
    ppo.train_ppo(config_from_dict(tree(unbroken)), runtime)
    expected = metrics(unbroken)
    ptx_losses = [r["policy/ptx_loss"] for r in expected]
    assert len(set(ptx_losses)) == 3, ptx_losses  # each iteration drew other rows

    out = tmp_path / "killed"
    kill_at(monkeypatch, ppo_update, "update", 2)  # after the 1st of iteration 2's 2 steps
    with pytest.raises(Killed):
        ppo.train_ppo(config_from_dict(tree(out)), runtime)
    monkeypatch.undo()
    state = torch.load(out / "checkpoints" / "step-000001" / "trainer.pt", weights_only=True)
    assert state["ptx_position"] == 2  # two optimizer steps, one ptx batch each
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-000001"
    ppo.train_ppo(config_from_dict(tree(out, resume="auto")), runtime)
    assert metrics(out) == expected  # bitwise, iterations 1-3


# ------------------------------------------------------------- the measurement


# GRPO (critic-free: the cheapest estimator of the one loop) with a high learning rate, so
# that a few iterations both learn the gold reward and forget SFT rows measurably.
PTX_DEMO_PPO = {
    "estimator": "grpo",
    "iterations": 8,
    "rollout_batch_size": 8,
    "samples_per_prompt": 4,
    "rollout_micro_batch_size": 32,
    "ppo_epochs": 2,
    "minibatch_size": 16,
    "micro_batch_size": 16,
    "optim": {"lr": 1e-3},
    "kl_coef": 0.05,
}
PTX_DEMO_COEF = 0.5


def held_out_sft_rows(path: Path, n: int = 128) -> Path:
    """SFT rows of the demo's distribution (uniform positive share) on held-out prompts."""
    rng = random.Random(2025)
    _, held_out = task.prompt_pools()
    with path.open("w", encoding="utf-8") as f:
        for _ in range(n):
            prompt, category = rng.choice(held_out)
            response = task.sample_response(rng, category, rng.random())
            f.write(json.dumps({"prompt": prompt, "response": response}) + "\n")
    return path


def test_ptx_keeps_the_held_out_sft_nll_at_a_similar_gold_reward(
    sft_run, task_env, runtime, tmp_path, data_cfg
):
    """The SFT policy, then PPO on the gold reward without and with ptx (data.ptx: the SFT
    training rows), from the same seed: PPO raises the policy's NLL on held-out SFT rows
    (it learns positive reviews, the SFT rows have every positive share); with ptx the rise
    is smaller, and the gold reward of the last 3 iterations' samples stays within 0.1."""
    pad = task_env.tokenizer.pad_token_id
    data = data_cfg(train=str(task_env.files.prompts))
    held = held_out_sft_rows(tmp_path / "held_out_sft.jsonl")
    rows = load_rows(str(held), "held-out SFT rows")
    examples, _ = sft_examples(rows, task_env.tokenizer, config_from_dict({"data": data}).data)

    def held_out_nll(policy: Path) -> float:
        return eval_nll(runtime, load_causal_lm(str(policy), "model.policy"), examples, 64, pad)

    def train(name: str, coef: float) -> tuple[float, float, float]:
        """(held-out NLL after PPO, gold of the first iteration, gold of the last three)."""
        out = tmp_path / name
        ptx = {"ptx": str(task_env.files.sft)} if coef else {}
        tree = {
            "run": {"output_dir": str(out), "seed": 0, "log_every": 1},
            "model": {"policy": str(sft_run.out / "final")},
            "data": data | ptx,
            "generation": {"max_new_tokens": 24, "temperature": 0.7},
            "reward": {"function": GOLD, "missing_eos_penalty": 0.0},
            "ppo": PTX_DEMO_PPO | {"ptx_coef": coef},
        }
        ppo.train_ppo(config_from_dict(tree), runtime)
        gold = [r["objective/score"] for r in metrics(out)]  # unfinished responses: 0
        return held_out_nll(out / "final"), gold[0], sum(gold[-3:]) / 3

    sft_nll = held_out_nll(sft_run.out / "final")
    plain_nll, sft_gold, plain_gold = train("plain", 0.0)
    ptx_nll, _, ptx_gold = train("ptx", PTX_DEMO_COEF)
    figures = (sft_nll, plain_nll, ptx_nll, sft_gold, plain_gold, ptx_gold)
    names = ("NLL SFT", "NLL PPO", "NLL PPO-ptx", "gold SFT", "gold PPO", "gold PPO-ptx")
    print(", ".join(f"{n} {v:.3f}" for n, v in zip(names, figures, strict=True)))
    assert plain_gold > sft_gold + 0.1, figures  # PPO learned
    assert plain_nll > sft_nll + 0.1, figures  # ... and forgot some of the SFT rows
    assert ptx_nll - sft_nll < 0.5 * (plain_nll - sft_nll), figures  # ptx: less than half
    assert abs(ptx_gold - plain_gold) <= 0.1, figures
