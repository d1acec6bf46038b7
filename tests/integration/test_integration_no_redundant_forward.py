"""No redundant forwards (docs/architecture.md section 10): with one optimizer step per
rollout and the KL in the loss, the rollout's scoring runs no actor pass; the old
log-probs and entropies come from the update's forward (ratio exactly 1). The run logs
the same metrics as with the separate pass (perf.old_logprobs_from_update=false, the
reference path), to 1e-6."""

from __future__ import annotations

import pytest

from rlhf_dist.config import config_from_dict
from rlhf_dist.config.sizes import old_logprobs_from_update
from rlhf_dist.models import ActorCritic
from rlhf_dist.trainers import ppo

POSITIVE_REWARD = "rlhf_dist.demo.task:positive_word_reward"
NOISY = ("time/", "throughput/", "memory/")


def grpo_tree(out, policy, data) -> dict:
    return {
        "run": {"output_dir": str(out), "seed": 0, "log_every": 1, "histogram_every": 1},
        "model": {"policy": str(policy)},
        "data": data,
        "generation": {"max_new_tokens": 16, "temperature": 0.7},
        "reward": {"function": POSITIVE_REWARD},
        "ppo": {
            "iterations": 2, "rollout_batch_size": 4, "samples_per_prompt": 4,
            "rollout_micro_batch_size": 8, "ppo_epochs": 1, "minibatch_size": 16,
            "micro_batch_size": 8, "optim": {"lr": 1e-3}, "estimator": "grpo",
            "kl_placement": "loss", "kl_kind": "k3", "kl_coef": 0.04, "entropy_coef": 0.01,
        },
    }  # fmt: skip


def run(tree, runtime, monkeypatch, read_jsonl, skip: bool):
    """metrics.jsonl rows and the number of actor passes in scoring (eval mode)."""
    scoring = []
    forward = ActorCritic.forward

    def counting(self, *args, with_actor=True, **kwargs):
        if not self.training and with_actor:
            scoring.append(1)
        return forward(self, *args, with_actor=with_actor, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(ActorCritic, "forward", counting)
        tree = tree | {"perf": {"old_logprobs_from_update": skip}}
        ppo.train_ppo(config_from_dict(tree), runtime)
    return read_jsonl(tree["run"]["output_dir"] + "/metrics.jsonl"), len(scoring)


def test_one_step_per_rollout_takes_old_logprobs_from_the_update(
    task_env, runtime, tmp_path, monkeypatch, data_cfg, read_jsonl
):
    data = data_cfg(train=str(task_env.files.prompts))
    cfg = config_from_dict(grpo_tree(tmp_path / "x", task_env.policy, data))
    assert old_logprobs_from_update(cfg)
    skipped, passes = run(
        grpo_tree(tmp_path / "skip", task_env.policy, data), runtime, monkeypatch, read_jsonl, True
    )
    assert passes == 0  # no actor forward in scoring
    separate, passes = run(
        grpo_tree(tmp_path / "sep", task_env.policy, data), runtime, monkeypatch, read_jsonl, False
    )
    assert passes == 4  # 16 sequences per iteration in rollout micro-batches of 8, x 2
    assert len(skipped) == len(separate) == 2
    for a, b in zip(skipped, separate):
        keys = [k for k in a if not k.startswith(NOISY)]
        assert keys == [k for k in b if not k.startswith(NOISY)]
        for k in keys:
            assert a[k] == pytest.approx(b[k], abs=1e-6, rel=1e-6), k
        assert a["policy/ratio_mean"] == 1.0 and a["policy/ratio_max"] == 1.0
        assert a["policy/approx_kl"] == 0.0 and a["objective/entropy"] > 0
    # iteration 1: the actor is the reference, though its log-probs come from the update's
    # forward and the reference's from scoring's (other batch shapes): equal up to rounding
    assert skipped[0]["objective/kl"] == pytest.approx(0.0, abs=1e-9)
    assert skipped[1]["objective/kl"] > 0.0


def test_the_skip_needs_one_step_and_the_kl_in_the_loss(task_env, data_cfg, tmp_path):
    data = data_cfg(train=str(task_env.files.prompts))
    tree = grpo_tree(tmp_path, task_env.policy, data)
    # ppo.cov_control chooses its tokens from the old log-probs before the update
    changes = ({"ppo_epochs": 2}, {"minibatch_size": 8}, {"kl_placement": "reward"})
    for change in (*changes, {"cov_control": "clip_cov"}):
        t = {**tree, "ppo": {**tree["ppo"], **change}}
        cfg = config_from_dict(t)
        assert not old_logprobs_from_update(cfg), change
