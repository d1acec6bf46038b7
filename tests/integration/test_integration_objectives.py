"""GSPO, CISPO and DAPO (ppo.ratio_level, ppo.policy_loss, ppo.dynamic_sampling,
ppo.overlong) in the PPO loop (docs/agents.md, "Objectives"):

- each objective trains the actor and leaves the reference and the reward model as they were;
- dynamic sampling drops exactly the tied groups, logs the right drop rate, and trains on
  a full batch without tied groups unless the round cap forced a top-up;
- overlong=mask trains nothing on truncated responses (their rows have no loss tokens).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from spies import capture_calls

from rlhf_dist.algo.objectives import tied_groups
from rlhf_dist.config import config_from_dict
from rlhf_dist.models import ActorCritic
from rlhf_dist.trainers.ppo import recipe as ppo
from rlhf_dist.trainers.ppo import rollout as ppo_rollout
from rlhf_dist.trainers.ppo import setup as ppo_setup

UNIT_TESTS = Path(__file__).resolve().parents[1] / "unit"
TIES = "reward_fns_for_tests:ties_on_some_prompts"  # tests/unit/reward_fns_for_tests.py

OBJECTIVES = {
    "gspo": {"ratio_level": "sequence", "loss_aggregation": "seq_mean_token_mean"},
    "cispo": {"policy_loss": "cispo", "clip_eps_low": 1.0, "clip_eps_high": 0.28},
    "dapo": {
        "clip_eps_high": 0.28,
        "dynamic_sampling": True,
        "overlong": "soft",
        "overlong_buffer": 8,
    },
}


def tree_for(out, policy, reward, data, **ppo_keys) -> dict:
    return {
        "run": {"output_dir": str(out), "seed": 0, "log_every": 1},
        "model": {"policy": str(policy), "reward": str(reward)},
        "data": data,
        "generation": {"max_new_tokens": 24, "temperature": 0.7},
        "ppo": {
            "iterations": 2,
            "rollout_batch_size": 8,
            "samples_per_prompt": 4,
            "rollout_micro_batch_size": 32,
            "ppo_epochs": 1,
            "minibatch_size": 16,
            "micro_batch_size": 8,
            "optim": {"lr": 1e-3},
            "estimator": "grpo",
            **ppo_keys,
        },
    }


@pytest.mark.parametrize("objective", list(OBJECTIVES))
def test_objective_trains_the_actor_and_nothing_frozen(
    objective,
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
    out = tmp_path / objective
    data = data_cfg(train=str(task_env.files.prompts))
    cfg = config_from_dict(tree_for(out, policy, reward, data, **OBJECTIVES[objective]))
    ppo.train_ppo(cfg, runtime)
    ((_, _, models),) = built
    net = runtime.unwrap(models.model)
    assert isinstance(net, ActorCritic) and net.critic is None
    initial = saved_state_dict(policy)
    actor = {k: v.detach().clone() for k, v in net.actor.state_dict().items()}
    assert changed_tensors(initial, actor) == list(initial)
    assert changed_tensors(initial, dict(models.reference.state_dict())) == []
    rm = models.scorer.reward_model.classifier.state_dict()
    assert changed_tensors(saved_state_dict(reward, "classifier"), rm) == []
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float)), r
        assert r["rollout/sequences"] == 32.0
    if objective == "dapo":
        # A reward model's scores do not tie: nothing dropped, no extra round.
        assert [r["rollout/dynamic_sampling_drop_rate"] for r in rows] == [0.0, 0.0]
        assert [r["rollout/dynamic_sampling_rounds"] for r in rows] == [0.0, 0.0]
        assert all(-1.0 <= r["objective/overlong_penalty"] <= 0.0 for r in rows)


def test_dynamic_sampling_drops_tied_groups_and_overlong_mask_trains_no_truncated_row(
    sft_run, task_env, runtime, tmp_path, monkeypatch, data_cfg, read_jsonl
):
    """A reward under which the groups of some prompts tie (reward_fns_for_tests)."""
    monkeypatch.setattr(sys, "path", [str(UNIT_TESTS), *sys.path])
    rollouts = capture_calls(monkeypatch, ppo_rollout, "collect_rollout")
    # The mask the update trains on (the trainer hands it a view of the rollout; the
    # rollout keeps its own mask for its statistics).
    updates, update = [], ppo.ppo_update

    def ppo_update(runtime, run, batch, *args, **kwargs):
        updates.append((batch, batch.response_mask.clone()))
        return update(runtime, run, batch, *args, **kwargs)

    monkeypatch.setattr(ppo, "ppo_update", ppo_update)
    out = tmp_path / "dynamic"
    keys = {"dynamic_sampling": True, "dynamic_sampling_max_rounds": 1, "overlong": "mask"}
    tree = tree_for(out, sft_run.out / "final", "", data_cfg(train=str(task_env.prompts)), **keys)
    del tree["model"]["reward"]
    tree["reward"] = {"function": TIES}
    tree["ppo"]["iterations"] = 4
    ppo.train_ppo(config_from_dict(tree), runtime)
    rows = read_jsonl(out / "metrics.jsonl")
    # Every rollout call of the run, in order; the iterations split them by their rounds.
    tied = [tied_groups(batch.scores, 4) for _, _, (batch, _) in rollouts]
    calls = iter(tied)
    for r, (batch, trained_mask) in zip(rows, updates):
        rounds = int(r["rollout/dynamic_sampling_rounds"])
        mine = torch.cat([next(calls) for _ in range(rounds + 1)])
        assert r["rollout/dynamic_sampling_groups"] == mine.numel() == 8 * (rounds + 1)
        assert r["rollout/dynamic_sampling_drop_rate"] == pytest.approx(mine.float().mean().item())
        untied = int((~mine).sum())
        assert rounds == 1 or untied >= 8  # more rounds only while the batch is short
        assert r["rollout/dynamic_sampling_filled"] == pytest.approx(max(0, 8 - untied) / 8)
        assert batch.scores.shape[0] == 32
        if untied >= 8:  # the trained batch holds no tied group
            assert not tied_groups(batch.scores, 4).any()
        # overlong=mask: truncated rows have no loss token; finished rows keep theirs
        has_tokens = trained_mask.any(1)
        assert torch.equal(has_tokens, batch.finished)
        assert r["rollout/overlong_masked_rate"] == pytest.approx(1 - r["rollout/eos_rate"])
    assert next(calls, None) is None
    assert any(r["rollout/dynamic_sampling_drop_rate"] > 0 for r in rows)
    assert any(r["rollout/dynamic_sampling_rounds"] > 0 for r in rows)
