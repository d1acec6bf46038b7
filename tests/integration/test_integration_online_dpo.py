"""Online DPO (ppo.estimator=online_dpo, docs/online_dpo.md) on the tiny task:

- labelled by the reward model: the actor trains, the reference and the reward model stay
  frozen, and every iteration logs the pair metrics (DPO loss, implicit rewards, accuracy,
  the labeller's scores, the share of tied groups) beside the KL to the reference;
- with LoRA the reference is the policy's base with its adapters off: only the adapters
  train, and the first rollout's KL to the reference is 0;
- through the Python API (`rlhf_dist.online_dpo`) with a reward function that ties often:
  tied groups are skipped and counted, the pairs are the untied groups, and the run
  exports a policy that differs from the one it started from.
"""

from __future__ import annotations

import json

import pytest
import torch
from spies import capture_calls

import rlhf_dist
from rlhf_dist.config import config_from_dict
from rlhf_dist.models.lora import AdapterOffReference
from rlhf_dist.trainers import ppo
from rlhf_dist.trainers.ppo import setup as ppo_setup

PAIR_METRICS = (
    "dpo/loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracy",
    "logprobs/chosen", "logprobs/rejected", "online_dpo/pairs", "online_dpo/tie_fraction",
    "online_dpo/score_chosen", "online_dpo/score_rejected", "online_dpo/score_margin",
    "objective/kl", "objective/score", "optim/grad_norm_actor",
)  # fmt: skip


def test_online_dpo_with_the_reward_model_trains_the_actor_only(
    sft_run, rm_run, task_env, runtime, tmp_path, monkeypatch, data_cfg, saved_state_dict,
    changed_tensors, read_jsonl,
):  # fmt: skip
    policy, reward = sft_run.out / "final", rm_run.out / "final"
    built = capture_calls(monkeypatch, ppo_setup, "build_models")
    out = tmp_path / "odpo"
    tree = {
        "run": {"output_dir": str(out), "seed": 0, "log_every": 1},
        "model": {"policy": str(policy), "reward": str(reward)},
        "data": data_cfg(train=str(task_env.files.prompts)),
        "generation": {"max_new_tokens": 12, "temperature": 0.7},
        "ppo": {
            "estimator": "online_dpo", "iterations": 2, "rollout_batch_size": 8,
            "samples_per_prompt": 3, "rollout_micro_batch_size": 24, "minibatch_size": 12,
            "micro_batch_size": 4, "ppo_epochs": 2, "kl_coef": 0.1, "dpo_loss": "ipo",
            "optim": {"lr": 1e-3},
        },
    }  # fmt: skip
    summary = ppo.train_ppo(config_from_dict(tree), runtime)
    assert summary["iterations"] == 2

    ((_, _, models),) = built
    net = runtime.unwrap(models.model)
    assert net.critic is None and models.group_names == ("actor",)
    initial = saved_state_dict(policy)
    actor = {k: v.detach().clone() for k, v in net.actor.state_dict().items()}
    assert changed_tensors(initial, actor) == list(initial)
    assert changed_tensors(initial, models.reference.state_dict()) == []
    rm = models.scorer.reward_model  # the labeller: frozen
    assert changed_tensors(saved_state_dict(reward, "seq"), rm.classifier.state_dict()) == []

    rows = read_jsonl(out / "metrics.jsonl")
    assert len(rows) == 2
    for row in rows:
        missing = [k for k in PAIR_METRICS if k not in row]
        assert not missing, missing
        # 8 groups of 3 (a real-valued RM hardly ties): pairs + ties = groups
        assert row["online_dpo/pairs"] == pytest.approx(8 * (1 - row["online_dpo/tie_fraction"]))
        assert row["online_dpo/score_margin"] > 0  # the best against the worst
        assert row["online_dpo/empty_steps"] == 0
    assert (out / "final" / "config.json").is_file()


def coarse_reward(calls: list):
    """1 if a response holds a positive word, else 0: ties are common. Records each call."""

    def coarse(prompts, responses):
        scores = [float(any(w in r.split() for w in ("great", "good", "love"))) for r in responses]
        calls.append(scores)
        return scores

    return coarse


def api_run(sft_run, task_env, out, reward_fn, **keys) -> dict:
    prompts = [json.loads(line) for line in task_env.files.prompts.read_text().splitlines()]
    return rlhf_dist.online_dpo(
        {
            "model.policy": str(sft_run.out / "final"), "run.output_dir": str(out),
            "run.seed": 0, "run.log_every": 1, "run.progress": False, "perf.num_threads": 1,
            "data.max_prompt_length": 16, "data.max_length": 48,
            "generation.max_new_tokens": 12, "ppo.iterations": 2, "ppo.rollout_batch_size": 8,
            "ppo.optim.lr": 1e-3, **keys,
        },
        dataset=prompts[:64],
        reward_fn=reward_fn,
    )  # fmt: skip


def test_the_python_api_skips_and_counts_ties(sft_run, task_env, tmp_path, read_jsonl):
    calls: list[list[float]] = []
    out = tmp_path / "api"
    summary = api_run(sft_run, task_env, out, coarse_reward(calls))
    assert summary["iterations"] == 2
    rows = read_jsonl(out / "metrics.jsonl")
    assert len(calls) == len(rows) == 2
    for scores, row in zip(calls, rows):
        pairs = [scores[i : i + 2] for i in range(0, len(scores), 2)]  # the preset's n = 2
        untied = sum(a != b for a, b in pairs)
        assert row["online_dpo/pairs"] == untied
        assert row["online_dpo/tie_fraction"] == pytest.approx(1 - untied / len(pairs))
        if untied:  # the chosen response scored 1, the rejected 0
            assert row["online_dpo/score_margin"] == pytest.approx(1.0)
    assert 0 < sum(r["online_dpo/tie_fraction"] for r in rows) < 2  # ties and pairs both seen
    effective = (out / "config.yaml").read_text()
    assert "estimator: online_dpo" in effective and "kl_coef: 0.1" in effective


def test_dynamic_sampling_refills_the_tied_groups(sft_run, task_env, tmp_path, read_jsonl):
    out = tmp_path / "dynamic"
    keys = {"ppo.dynamic_sampling": True, "ppo.dynamic_sampling_max_rounds": 3}
    api_run(sft_run, task_env, out, coarse_reward([]), **keys)
    rows = read_jsonl(out / "metrics.jsonl")
    assert any(r["rollout/dynamic_sampling_drop_rate"] > 0 for r in rows)  # ties were sampled
    for row in rows:  # ... and the trained batch holds only those the rounds could not replace
        assert row["online_dpo/tie_fraction"] == pytest.approx(
            row["rollout/dynamic_sampling_filled"]
        )
        assert row["online_dpo/pairs"] == pytest.approx(8 * (1 - row["online_dpo/tie_fraction"]))


def test_with_lora_the_reference_is_the_base_with_adapters_off(
    sft_run, task_env, runtime, tmp_path, monkeypatch, data_cfg, saved_state_dict, read_jsonl
):
    policy = sft_run.out / "final"
    built = capture_calls(monkeypatch, ppo_setup, "build_models")
    out = tmp_path / "odpo_lora"
    tree = {
        "run": {"output_dir": str(out), "seed": 0, "log_every": 1},
        "model": {"policy": str(policy)},
        "data": data_cfg(train=str(task_env.files.prompts)),
        "generation": {"max_new_tokens": 12, "temperature": 0.7},
        "reward": {"function": "rlhf_dist.demo.task:positive_word_reward"},
        "lora": {"enabled": True, "r": 4},
        "ppo": {
            "estimator": "online_dpo", "iterations": 2, "rollout_batch_size": 8,
            "samples_per_prompt": 4, "kl_coef": 0.1, "optim": {"lr": 1e-2},
        },
    }  # fmt: skip
    ppo.train_ppo(config_from_dict(tree), runtime)
    ((_, _, models),) = built
    assert isinstance(models.reference, AdapterOffReference)
    net = runtime.unwrap(models.model)
    trained = {n: p for n, p in net.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    assert any(p.abs().sum() > 0 for n, p in trained.items() if "lora_B" in n)  # B starts at 0
    initial = saved_state_dict(policy)
    base = {
        n.replace("base_model.model.", "").replace("base_layer.", ""): p
        for n, p in net.actor.state_dict().items()
        if "lora_" not in n
    }
    for name, tensor in initial.items():
        assert torch.equal(base[name], tensor), name
    rows = read_jsonl(out / "metrics.jsonl")
    assert abs(rows[0]["objective/kl"]) < 1e-4  # fresh adapters: the actor is the reference
    assert rows[1]["objective/kl"] > 1e-4 and rows[0]["online_dpo/pairs"] > 0
