"""Critic-free estimators (ppo.estimator = grpo, rloo, reinforce_pp, reinforce_pp_baseline)
in the PPO loop (docs/architecture.md section 5):

- no critic is built, held, optimised or exported; the actor trains, the reference and the
  reward model stay frozen;
- the n samples of a prompt are consecutive rows of one rank's rollout (the groups the
  estimators read);
- each critic-free estimator raises a reward function's score;
- the objective knobs (KL as a loss term, entropy bonus, clip-higher, dual clip) run and
  log their statistics.
"""

from __future__ import annotations

import math

import pytest
import torch
from spies import capture_calls

from rlhf_dist.config import config_from_dict
from rlhf_dist.models import ActorCritic
from rlhf_dist.trainers import ppo
from rlhf_dist.trainers.ppo import advantages as ppo_advantages
from rlhf_dist.trainers.ppo import prompts as ppo_prompts
from rlhf_dist.trainers.ppo import rollout as ppo_rollout
from rlhf_dist.trainers.ppo import setup as ppo_setup

POSITIVE_REWARD = "rlhf_dist.demo.task:positive_word_reward"


def tree_for(out, policy, data, estimator: str, **ppo_keys) -> dict:
    return {
        "run": {"output_dir": str(out), "seed": 0, "log_every": 1},
        "model": {"policy": str(policy)},
        "data": data,
        "generation": {"max_new_tokens": 24, "temperature": 0.7},
        "reward": {"function": POSITIVE_REWARD},
        "ppo": {
            "iterations": 2,
            "rollout_batch_size": 8,
            "samples_per_prompt": 4,
            "rollout_micro_batch_size": 32,
            "ppo_epochs": 1,
            "minibatch_size": 16,
            "micro_batch_size": 8,
            "optim": {"lr": 1e-3},
            "kl_coef": 0.05,
            "estimator": estimator,
            **ppo_keys,
        },
    }


def test_grpo_builds_no_critic_trains_the_actor_and_keeps_groups_on_one_rank(
    sft_run,
    rm_run,
    task_env,
    runtime,
    tmp_path,
    monkeypatch,
    data_cfg,
    saved_state_dict,
    changed_tensors,
    read_jsonl,
):
    policy, reward = sft_run.out / "final", rm_run.out / "final"
    built = capture_calls(monkeypatch, ppo_setup, "build_models")
    estimates = capture_calls(monkeypatch, ppo_advantages, "estimate_advantages")
    rollouts = capture_calls(monkeypatch, ppo_rollout, "collect_rollout")
    out = tmp_path / "grpo"
    tree = tree_for(out, policy, data_cfg(train=str(task_env.files.prompts)), "grpo")
    tree["model"]["reward"] = str(reward)
    del tree["reward"]
    ppo.train_ppo(config_from_dict(tree), runtime)

    ((_, _, models),) = built
    net = runtime.unwrap(models.model)
    assert isinstance(net, ActorCritic) and net.critic is None
    assert models.group_names == ("actor",)
    assert len(models.optimizer.param_groups) == 1
    # The trained module's parameter bytes are the actor's alone.
    nbytes = sum(p.numel() * p.element_size() for p in net.parameters())
    assert nbytes == sum(p.numel() * p.element_size() for p in net.actor.parameters())

    initial = saved_state_dict(policy)
    actor = {k: v.detach().clone() for k, v in net.actor.state_dict().items()}
    assert changed_tensors(initial, actor) == list(initial)
    reference = {k: v for k, v in models.reference.state_dict().items()}
    assert changed_tensors(initial, reference) == []
    initial_rm = saved_state_dict(reward, "classifier")
    rm = models.scorer.reward_model.classifier.state_dict()
    assert changed_tensors(initial_rm, rm) == []

    assert (out / "final").is_dir() and not (out / "critic").exists()
    assert changed_tensors(actor, saved_state_dict(out / "final")) == []

    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert not any(k.startswith("value/") for k in rows[0])
    assert "optim/grad_norm_actor" in rows[0] and "optim/grad_norm_critic" not in rows[0]
    assert rows[0]["rollout/sequences"] == 32.0  # 8 prompts x 4 samples

    # Groups: rows [4g, 4g+4) of the rollout are four samples of ONE prompt.
    for (_, prompts, *_), _, _ in rollouts:
        prompt_ids = prompts.ids
        assert prompt_ids.shape[0] == 32
        groups = prompt_ids.reshape(8, 4, -1)
        assert torch.equal(groups, groups[:, :1].expand_as(groups))
        assert len({tuple(g[0].tolist()) for g in groups}) > 1
    for (name, inputs), _, (advantages, returns) in estimates:
        assert name == "grpo" and returns is None and inputs.group_size == 4
        # A group's advantages sum to 0 (mean baseline), and they are not all 0.
        per_seq = advantages[:, 0].reshape(8, 4)
        assert torch.allclose(per_seq.sum(1), torch.zeros(8), atol=1e-4)
        assert per_seq.abs().sum() > 0


def test_prompt_stream_repeats_each_prompt_n_times_in_a_row(runtime, task_env):
    from rlhf_dist.data.batching import ppo_plan
    from rlhf_dist.data.rows import PromptSet

    cfg = config_from_dict({"ppo": {"rollout_batch_size": 4, "samples_per_prompt": 3}})
    plan = ppo_plan(cfg.ppo, world_size=1)
    prompts = PromptSet(
        ids=[[5 + i] * (1 + i % 3) for i in range(8)],
        texts=[f"p{i}" for i in range(8)],
        report=None,
    )
    batch = next(ppo_prompts.prompt_stream(prompts, plan, runtime, seed=0, pad_id=0))
    ids, texts = batch.ids, batch.texts
    assert ids.shape[0] == 12 and len(texts) == 12
    for g in range(4):
        group = texts[3 * g : 3 * g + 3]
        assert group == [group[0]] * 3
        assert torch.equal(ids[3 * g], ids[3 * g + 1]) and torch.equal(ids[3 * g], ids[3 * g + 2])
    assert len(set(texts)) == 4


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_critic_free_estimators_raise_a_reward_function_score(
    estimator, sft_run, task_env, runtime, tmp_path, data_cfg, read_jsonl
):
    out = tmp_path / estimator
    tree = tree_for(
        out,
        sft_run.out / "final",
        data_cfg(train=str(task_env.prompts)),
        estimator,
        iterations=12,
        ppo_epochs=2,
    )
    ppo.train_ppo(config_from_dict(tree), runtime)
    scores = [r["objective/score"] for r in read_jsonl(out / "metrics.jsonl")]
    first, last = sum(scores[:2]) / 2, sum(scores[-3:]) / 3
    # The SFT policy scores ~0 on this (-1..1) scale (see test_integration_ppo).
    assert last > first + 0.2, scores


def test_objective_knobs_run_and_log_their_statistics(
    sft_run, task_env, runtime, tmp_path, data_cfg, read_jsonl
):
    out = tmp_path / "knobs"
    tree = tree_for(
        out,
        sft_run.out / "final",
        data_cfg(train=str(task_env.prompts)),
        "rloo",
        kl_placement="loss",
        kl_kind="k3",
        entropy_coef=0.01,
        clip_eps_high=0.28,
        dual_clip=3.0,
        loss_aggregation="seq_mean_token_mean",
    )
    ppo.train_ppo(config_from_dict(tree), runtime)
    rows = read_jsonl(out / "metrics.jsonl")
    for key in ("policy/kl_loss", "policy/entropy", "policy/clipfrac", "objective/kl"):
        assert all(math.isfinite(r[key]) for r in rows), key
    # k3 is >= 0 per token; the actor starts equal to the reference and then moves.
    assert all(r["policy/kl_loss"] >= 0 for r in rows)
    assert rows[-1]["policy/kl_loss"] > 1e-6


def test_grpo_with_lora_trains_only_the_adapters_and_exports_no_critic(
    sft_run, task_env, runtime, tmp_path, monkeypatch, data_cfg, saved_state_dict, read_jsonl
):
    built = capture_calls(monkeypatch, ppo_setup, "build_models")
    out = tmp_path / "grpo_lora"
    tree = tree_for(out, sft_run.out / "final", data_cfg(train=str(task_env.prompts)), "grpo")
    tree["lora"] = {"enabled": True, "r": 4}
    ppo.train_ppo(config_from_dict(tree), runtime)
    ((_, _, models),) = built
    net = runtime.unwrap(models.model)
    assert net.critic is None and models.group_names == ("actor",)
    trained = {n: p for n, p in net.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    # Adapters moved (lora_B starts at 0); the base weights are the SFT policy's.
    assert any(p.abs().sum() > 0 for n, p in trained.items() if "lora_B" in n)
    initial = saved_state_dict(sft_run.out / "final")
    base = {
        n.replace("base_model.model.", "").replace("base_layer.", ""): p
        for n, p in net.actor.state_dict().items()
        if "lora_" not in n
    }
    for name, tensor in initial.items():
        assert torch.equal(base[name], tensor), name
    assert (out / "final").is_dir() and (out / "final_adapter").is_dir()
    assert not (out / "critic").exists()
    rows = read_jsonl(out / "metrics.jsonl")
    assert abs(rows[0]["objective/kl"]) < 1e-4  # adapters start at 0: actor == reference
