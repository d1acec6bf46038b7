"""PPO on the tiny demo task (docs/architecture.md sections 4, 5 and 8).

- with the trained reward model: actor and critic train, reference and reward model stay
  frozen, the run leaves its inputs untouched, the logged KL starts at 0;
- with a reward function on a user prompt file: the score goes up;
- the batch arithmetic of one iteration (epochs x minibatches x micro-batches);
- one optimizer step's gradient does not depend on the micro-batch split.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import types
from collections import Counter

import pytest
import torch
from packed_models import packed, shared_rows

from rlhf_dist.config import config_from_dict, to_dict
from rlhf_dist.data.batching import BatchPlan, global_batches, ppo_plan
from rlhf_dist.data.rows import collate_sft
from rlhf_dist.engine.forward import token_logprobs
from rlhf_dist.models import ActorCritic
from rlhf_dist.rewards.scoring import Scorer
from rlhf_dist.trainers.ppo import advantages as ppo_advantages
from rlhf_dist.trainers.ppo import recipe as ppo
from rlhf_dist.trainers.ppo import rollout as ppo_rollout
from rlhf_dist.trainers.ppo import setup as ppo_setup
from rlhf_dist.trainers.ppo.ptx import ptx_stream
from rlhf_dist.trainers.ppo.update import update_micro_batches

POSITIVE_REWARD = "rlhf_dist.demo.task:positive_word_reward"


def ppo_tree(out, policy, data, **sections) -> dict:
    """A PPO config tree with the demo's generation settings; `sections` update sections."""
    tree = {
        "run": {"output_dir": str(out), "seed": 0, "log_every": 1},
        "model": {"policy": str(policy)},
        "data": data,
        "generation": {"max_new_tokens": 24, "temperature": 0.7},
        "ppo": {
            "iterations": 4,
            "rollout_batch_size": 16,
            "rollout_micro_batch_size": 16,
            "ppo_epochs": 2,
            "minibatch_size": 8,
            "micro_batch_size": 8,
            "optim": {"lr": 3e-4},
            "critic_optim": {"lr": 3e-4},
            "kl_coef": 0.05,
        },
    }
    for name, values in sections.items():
        tree[name] = {**tree.get(name, {}), **values}
    return tree


def _parts(result, runtime):
    """(actor_critic, optimizer, reference, scorer), found by type in what build_models
    returned (a tuple or a dataclass: the tests do not depend on its layout)."""
    items = list(result) if isinstance(result, tuple) else list(vars(result).values())
    modules = [x for x in items if isinstance(x, torch.nn.Module)]
    (actor_critic,) = [m for m in modules if isinstance(runtime.unwrap(m), ActorCritic)]
    (reference,) = [m for m in modules if m is not actor_critic]
    (optimizer,) = [x for x in items if isinstance(x, torch.optim.Optimizer)]
    (scorer,) = [x for x in items if isinstance(x, Scorer)]
    return runtime.unwrap(actor_critic), optimizer, reference, scorer


def _keep_built_models(monkeypatch, on_build=None) -> list:
    """Wrap ppo.build_models: keep what it returns (and call on_build on it) per run."""
    built = []
    original = ppo_setup.build_models

    def keep(*args, **kwargs):
        built.append(original(*args, **kwargs))
        if on_build is not None:
            on_build(built[-1])
        return built[-1]

    monkeypatch.setattr(ppo_setup, "build_models", keep)
    return built


def _tensors(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


# ---------------------------------------------------------------- four models, one run


def test_ppo_trains_actor_and_critic_and_leaves_frozen_models_and_inputs_alone(
    sft_run,
    rm_run,
    task_env,
    runtime,
    tmp_path,
    monkeypatch,
    data_cfg,
    dir_digest,
    saved_state_dict,
    changed_tensors,
    read_jsonl,
):
    policy, reward = sft_run.out / "final", rm_run.out / "final"
    inputs = {p: dir_digest(p) for p in (policy, reward)}
    prompts_bytes = task_env.files.prompts.read_bytes()
    built = _keep_built_models(monkeypatch)
    out = tmp_path / "ppo"
    tree = ppo_tree(out, policy, data_cfg(train=str(task_env.files.prompts)))
    tree["model"]["reward"] = str(reward)
    summary = ppo.train_ppo(config_from_dict(tree), runtime)
    assert summary["iterations"] == 4

    # The run must not write into its inputs (models are loaded, never saved back).
    assert {p: dir_digest(p) for p in inputs} == inputs
    assert task_env.files.prompts.read_bytes() == prompts_bytes

    (result,) = built
    actor_critic, _, reference, scorer = _parts(result, runtime)
    initial_policy = saved_state_dict(policy)
    initial_rm = saved_state_dict(reward, "classifier")
    actor, critic = _tensors(actor_critic.actor), _tensors(actor_critic.critic.classifier)
    # Trained: every weight tensor of both moved (the critic starts as the reward model).
    assert changed_tensors(initial_policy, actor) == list(initial_policy)
    assert changed_tensors(initial_rm, critic) == list(initial_rm)
    # Frozen: bit-identical to their sources, and not even marked trainable.
    assert changed_tensors(initial_policy, _tensors(reference)) == []
    assert changed_tensors(initial_rm, _tensors(scorer.reward_model.classifier)) == []
    assert not any(p.requires_grad for p in reference.parameters())
    assert not any(p.requires_grad for p in scorer.reward_model.parameters())

    # The exports are the trained models.
    assert changed_tensors(actor, saved_state_dict(out / "final")) == []
    assert changed_tensors(critic, saved_state_dict(out / "critic", "classifier")) == []

    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for row in rows:
        for key in (
            "objective/score",
            "objective/kl",
            "policy/clipfrac",
            "value/explained_variance",
        ):
            assert math.isfinite(row[key]), (row["step"], key)
    # Iteration 1 samples from an actor equal to the reference: the k1 KL summed over each
    # response is 0 up to float noise. By the last iteration the actor has moved.
    assert abs(rows[0]["objective/kl"]) < 1e-4
    assert abs(rows[-1]["objective/kl"]) > 1e-3


# -------------------------------------------------------------- learning on a function


def test_ppo_raises_a_reward_function_score_on_user_prompts(
    sft_run, task_env, runtime, tmp_path, data_cfg, read_jsonl
):
    out = tmp_path / "ppo_fn"
    tree = ppo_tree(
        out,
        sft_run.out / "final",
        data_cfg(train=str(task_env.prompts)),
        reward={"function": POSITIVE_REWARD},
        ppo={
            "iterations": 20,
            "rollout_batch_size": 32,
            "rollout_micro_batch_size": 32,
            "ppo_epochs": 2,
            "minibatch_size": 16,
            "micro_batch_size": 16,
            "optim": {"lr": 1e-3},
            "critic_optim": {"lr": 1e-3},
            # No reward model to start the critic from.
            "critic_init": "policy",
        },
    )
    ppo.train_ppo(config_from_dict(tree), runtime)
    scores = [r["objective/score"] for r in read_jsonl(out / "metrics.jsonl")]
    assert len(scores) == 20
    first, last = sum(scores[:3]) / 3, sum(scores[-5:]) / 5
    # The SFT data has a uniform share of positive clauses, so the SFT policy scores ~0 on
    # this (-1..1) scale; the run reaches ~0.7 (run.seed 0-5 all gained 0.55-0.7).
    assert last > first + 0.3, scores


# ------------------------------------------------------------------------ batch math


def test_ppo_iteration_runs_epochs_x_minibatches_of_micro_batches(
    task_env, runtime, tmp_path, monkeypatch, data_cfg, read_jsonl
):
    events = []  # ("forward", rows) in update (training) mode, ("step",) per optimizer step
    rollouts = []
    forward = ActorCritic.forward

    def counting_forward(self, *args, **kwargs):
        if self.training:
            input_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
            events.append(("forward", [tuple(r) for r in input_ids.tolist()]))
        return forward(self, *args, **kwargs)

    def count_steps(result):
        # The torch optimizer inside Accelerate's wrapper: Runtime steps it directly.
        optimizer = _parts(result, runtime)[1]
        optimizer = getattr(optimizer, "optimizer", optimizer)
        step = optimizer.step

        def counted_step(self, *a, **k):
            events.append(("step",))
            return step(*a, **k)

        # A bound method, as torch's LR scheduler expects to find one there.
        optimizer.step = types.MethodType(counted_step, optimizer)

    collect_rollout = ppo_rollout.collect_rollout

    def keep_rollout(*args, **kwargs):
        batch, texts = collect_rollout(*args, **kwargs)
        rollouts.append([tuple(r) for r in batch.input_ids.tolist()])
        return batch, texts

    monkeypatch.setattr(ActorCritic, "forward", counting_forward)
    _keep_built_models(monkeypatch, on_build=count_steps)
    monkeypatch.setattr(ppo_rollout, "collect_rollout", keep_rollout)
    out = tmp_path / "ppo_math"
    tree = ppo_tree(
        out,
        task_env.policy,
        data_cfg(train=str(task_env.files.prompts)),
        generation={"max_new_tokens": 8},
        reward={"function": POSITIVE_REWARD},
        ppo={
            "iterations": 2,
            "rollout_batch_size": 16,
            "rollout_micro_batch_size": 8,
            "ppo_epochs": 2,
            "minibatch_size": 8,
            "micro_batch_size": 4,
            "critic_init": "policy",
            # A linear decay to 0 over all steps makes the logged lr count the steps taken.
            "optim": {"lr": 1e-4, "schedule": "linear"},
        },
    )
    ppo.train_ppo(config_from_dict(tree), runtime)

    # Per iteration: 2 epochs x (16 / 8) minibatches = 4 optimizer steps, each after
    # 8 / 4 = 2 micro-batch forward/backward passes of 4 sequences.
    kinds = "".join("F" if e[0] == "forward" else "S" for e in events)
    assert kinds == "FFS" * 4 * 2
    forwards = [e[1] for e in events if e[0] == "forward"]
    assert all(len(rows) == 4 for rows in forwards)
    # Each epoch visits every rollout sequence exactly once (compared without PAD: a
    # micro-batch drops the columns that are padding in all of its rows).
    pad = task_env.tokenizer.pad_token_id

    def tokens(rows):
        return Counter(tuple(t for t in row if t != pad) for row in rows)

    assert len(rollouts) == 2
    for it, rollout in enumerate(rollouts):
        for epoch in range(2):
            start = (it * 2 + epoch) * 4
            seen = [row for rows in forwards[start : start + 4] for row in rows]
            assert tokens(seen) == tokens(rollout), (it, epoch)

    # The scheduler stepped with the optimizer: 4 of 8 total steps after iteration 1.
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["optim/lr_actor"] for r in rows] == pytest.approx([0.5e-4, 0.0], abs=1e-12)
    # Padding shares (docs/metrics.md): left-padded prompts and responses cut at EOS pad
    # the rollout; a micro-batch drops all-padding columns, so it pays no more than that.
    for r in rows:
        assert 0 <= r["update/pad_fraction"] <= r["rollout/pad_fraction"] < 1, r
    # The memory plan of each phase rides along (its measured side exists on GPUs only).
    assert all(r["memory/planned_update_gib"] > r["memory/planned_scoring_gib"] > 0 for r in rows)
    assert "memory/measured_update_gib" not in rows[0]


# ----------------------------------------------------------------- split invariance


class GradRecorder(torch.optim.Optimizer):
    """An optimizer that records the gradient of every step and leaves the weights alone;
    param groups [actor, critic] as the trainer's own optimizer (one max norm each)."""

    def __init__(self, model):
        groups, self.names = [], []
        for part in ("actor", "critic"):
            named = [(f"{part}.{n}", p) for n, p in getattr(model, part).named_parameters()]
            named = [(n, p) for n, p in named if p.requires_grad]
            self.names += [n for n, _ in named]
            groups.append({"params": [p for _, p in named]})
        super().__init__(groups, {"lr": 0.0})
        self.grads: list[dict[str, torch.Tensor]] = []

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"]]
        self.grads.append(
            {n: p.grad.clone() for n, p in zip(self.names, params) if p.grad is not None}
        )


def test_ppo_step_gradient_does_not_depend_on_the_micro_batch_split(
    sft_run, task_env, runtime, tmp_path, monkeypatch, data_cfg
):
    # Take a real rollout batch, its advantages and returns, and the trained actor-critic
    # from one short PPO iteration, by catching the trainer's own call to ppo_update.
    calls = []
    original = ppo.ppo_update

    def keep(*args, **kwargs):
        calls.append(inspect.signature(original).bind(*args, **kwargs).arguments)
        return original(*args, **kwargs)

    monkeypatch.setattr(ppo, "ppo_update", keep)
    tree = ppo_tree(
        tmp_path / "ppo_split",
        sft_run.out / "final",
        data_cfg(train=str(task_env.files.prompts)),
        reward={"function": POSITIVE_REWARD},
        ppo={
            "iterations": 1,
            "minibatch_size": 16,
            "micro_batch_size": 16,
            "critic_init": "policy",
            "optim": {"lr": 1e-3},
            "critic_optim": {"lr": 1e-3},
        },
    )
    ppo.train_ppo(config_from_dict(tree), runtime)
    (args,) = calls
    batch = args["batch"]
    lengths = batch.response_mask.sum(1)
    # Ragged responses (the SFT policy stops at EOS), so micro-batches hold unequal token
    # counts and a per-micro-batch mean would weight tokens differently.
    assert len(set(lengths.tolist())) >= 4, lengths
    # After one iteration of updates the ratio to the rollout policy is no longer 1, so
    # the clipped branches of both losses take part in the gradient.
    base = copy.deepcopy(runtime.unwrap(args["run"].model))

    def step_grads(micro_batch_size, micro_batch_tokens=0, packing=False):
        t = to_dict(config_from_dict(tree))
        # A tight value clip: the critic moved little in one iteration, and the clipped
        # value branch should be exercised as well.
        t["ppo"] |= {"micro_batch_size": micro_batch_size, "ppo_epochs": 1, "value_clip_eps": 1e-3}
        t["ppo"]["micro_batch_tokens"] = micro_batch_tokens
        # Norm clipping off: the recorder then sees the raw accumulated gradient.
        t["ppo"]["optim"]["max_grad_norm"] = t["ppo"]["critic_optim"]["max_grad_norm"] = 1e9
        cfg = config_from_dict(t)
        model = packed(copy.deepcopy(base)) if packing else copy.deepcopy(base)
        recorder = GradRecorder(model)
        scheduler = torch.optim.lr_scheduler.LambdaLR(recorder, lambda _: 1.0)
        torch.manual_seed(0)  # the same minibatch order for both splits
        run = dataclasses.replace(
            args["run"],
            model=model,
            optimizer=recorder,
            scheduler=scheduler,
            plan=ppo_plan(cfg.ppo, runtime.world_size),
        )
        call = {**args, "run": run, "knobs": ppo.UpdateKnobs.from_config(cfg)}
        stats = original(**call).stats
        (grads,) = recorder.grads  # minibatch 16 = the whole rollout: one step
        return grads, stats

    whole, stats_whole = step_grads(16)
    split, stats_split = step_grads(4)
    assert stats_whole["policy/clipfrac"] > 0 and stats_whole["value/clipfrac"] > 0
    for key in ("policy/loss", "value/loss", "policy/clipfrac", "policy/approx_kl"):
        assert stats_split[key] == pytest.approx(stats_whole[key], rel=1e-5, abs=1e-9), key
    assert whole.keys() == split.keys()
    assert any(k.startswith("actor.") for k in whole) and any(
        k.startswith("critic.") for k in whole
    )
    for name in whole:
        scale = whole[name].norm()
        assert (split[name] - whole[name]).norm() <= 1e-5 * scale + 1e-12, name

    # ppo.micro_batch_tokens through ppo_update: rows sorted by length, several
    # micro-batches of different row counts, the same gradient and less padding.
    widths = (batch.prompt_mask.sum(1) + lengths).tolist()
    budget = 3 * max(widths)
    groups = update_micro_batches(runtime, batch, BatchPlan(16, 1, 16, budget))
    assert len(groups) >= 3 and len({len(g) for g in groups}) >= 2, groups
    budgeted, stats_budget = step_grads(16, budget)
    for key in ("policy/loss", "value/loss", "policy/clipfrac", "policy/approx_kl"):
        assert stats_budget[key] == pytest.approx(stats_whole[key], rel=1e-5, abs=1e-9), key
    # 1e-5 as for the split above: with shared prompts (perf.shared_prompt_forward) each
    # micro-batch runs its own distinct prompts, so the sums group differently (1.1e-6 seen).
    for name in whole:
        scale = whole[name].norm()
        assert (budgeted[name] - whole[name]).norm() <= 1e-5 * scale + 1e-12, name
    assert 0 <= stats_budget["update/pad_fraction"] < stats_whole["update/pad_fraction"] < 1

    # perf.packed_sequences: actor and critic forwards on each micro-batch's packed rows
    # (left-padded prompts + right-padded responses), by 4 and by the token budget,
    # several sequences per packed row.
    rows = shared_rows(monkeypatch)
    for micro, tokens in ((4, 0), (16, budget)):
        packed_grads, stats_packed = step_grads(micro, tokens, packing=True)
        for key in ("policy/loss", "value/loss", "policy/clipfrac", "policy/approx_kl"):
            assert stats_packed[key] == pytest.approx(stats_whole[key], rel=1e-5, abs=1e-9), key
        for name in whole:
            scale = whole[name].norm()
            assert (packed_grads[name] - whole[name]).norm() <= 1e-5 * scale + 1e-12, name
    assert any(packed_rows < padded for padded, packed_rows in rows), rows


def test_ppo_ptx_term_is_the_global_token_mean_nll_whatever_the_split(
    sft_run, task_env, runtime, tmp_path, monkeypatch, data_cfg, read_jsonl
):
    """PPO-ptx (trainers/ppo/ptx.py): one optimizer step's gradient with ppo.ptx_coef is the
    same for 1 x 16, 2 x 8 and 4 x 4 micro-batches, and it exceeds the step without ptx
    by exactly ptx_coef x the gradient of the token-mean NLL of the step's 16 ptx rows
    (the first batch of their seed-determined stream), computed here on its own."""
    calls, original = [], ppo.ppo_update

    def keep(*args, **kwargs):
        calls.append(inspect.signature(original).bind(*args, **kwargs).arguments)
        return original(*args, **kwargs)

    monkeypatch.setattr(ppo, "ppo_update", keep)
    coef, out = 0.5, tmp_path / "ptx_split"
    tree = ppo_tree(
        out,
        sft_run.out / "final",
        data_cfg(train=str(task_env.files.prompts), ptx=str(task_env.files.sft)),
        reward={"function": POSITIVE_REWARD},
        ppo={"iterations": 1, "minibatch_size": 16, "micro_batch_size": 16, "ptx_coef": coef},
    )
    tree["ppo"] |= {"critic_init": "policy", "ppo_epochs": 1}
    ppo.train_ppo(config_from_dict(tree), runtime)
    (row,) = read_jsonl(out / "metrics.jsonl")
    assert 0 < row["policy/ptx_loss"] < 10, row  # logged: the SFT rows' NLL, in nats
    (args,) = calls
    base = copy.deepcopy(runtime.unwrap(args["run"].model))

    def step_grads(micro_batch_size, ptx_on=True):
        t = to_dict(config_from_dict(tree))
        t["ppo"] |= {"micro_batch_size": micro_batch_size}
        t["ppo"]["optim"]["max_grad_norm"] = t["ppo"]["critic_optim"]["max_grad_norm"] = 1e9
        cfg = config_from_dict(t)
        model, plan = copy.deepcopy(base), ppo_plan(cfg.ppo, runtime.world_size)
        recorder = GradRecorder(model)
        stream = ptx_stream(cfg, runtime, args["run"].tokenizer, plan.update) if ptx_on else None
        torch.manual_seed(0)  # the same minibatch order for every split
        run = dataclasses.replace(
            args["run"], model=model, optimizer=recorder, plan=plan, ptx=stream,
            scheduler=torch.optim.lr_scheduler.LambdaLR(recorder, lambda _: 1.0),
        )  # fmt: skip
        knobs = ppo.UpdateKnobs.from_config(cfg)
        stats = original(**{**args, "run": run, "knobs": knobs}).stats
        (grads,) = recorder.grads
        return grads, stats

    (whole, stats), without = step_grads(16), step_grads(16, ptx_on=False)[0]
    assert stats["policy/ptx_loss"] > 0 and "policy/ptx_loss" not in step_grads(8, False)[1]
    for micro_batch_size in (8, 4):
        split, split_stats = step_grads(micro_batch_size)
        assert split_stats["policy/ptx_loss"] == pytest.approx(stats["policy/ptx_loss"], rel=1e-6)
        for name in whole:
            assert (split[name] - whole[name]).norm() <= 1e-5 * whole[name].norm() + 1e-12, name

    # The reference: coef x the gradient of the whole batch's token-mean NLL, in one pass.
    cfg, reference = config_from_dict(tree), copy.deepcopy(base)
    rows = ptx_stream(cfg, runtime, args["run"].tokenizer, ppo_plan(cfg.ppo, 1).update).examples
    _, idx = next(global_batches(len(rows), 16, cfg.run.seed, epochs=1))
    batch = collate_sft([rows[i] for i in idx], args["run"].tokenizer.pad_token_id)
    mask = batch["loss_mask"]
    logprobs, _ = token_logprobs(reference.actor, batch["input_ids"], batch["attention_mask"], mask)
    nll = -logprobs[mask].sum() / mask.sum()
    assert float(nll.detach()) == pytest.approx(stats["policy/ptx_loss"], rel=1e-5)
    (coef * nll).backward()
    moved = 0.0
    for name in whole:
        part, param = name.split(".", 1)
        grad = getattr(reference, part).get_parameter(param).grad  # None: the critic
        expected = torch.zeros_like(whole[name]) if grad is None else grad
        scale = expected.norm() + without[name].norm()
        assert (whole[name] - without[name] - expected).norm() <= 1e-5 * scale + 1e-9, name
        moved += float(expected.norm())
    assert moved > 0


# ------------------------------------------------------- reward post-processing options


def _scores_given_to_shape_rewards(monkeypatch, runtime, tree) -> list:
    """Run PPO; return [(raw scores of the rollout, scores passed to shape_rewards)] per
    iteration."""
    seen, raw = [], []
    shape, collect = ppo_advantages.shape_rewards, ppo_rollout.collect_rollout

    def keep_scores(scores, *args, **kwargs):
        seen.append(scores.detach().clone())
        return shape(scores, *args, **kwargs)

    def keep_raw(*args, **kwargs):
        batch, texts = collect(*args, **kwargs)
        raw.append(batch.raw_scores.clone())
        return batch, texts

    monkeypatch.setattr(ppo_advantages, "shape_rewards", keep_scores)
    monkeypatch.setattr(ppo_rollout, "collect_rollout", keep_raw)
    ppo.train_ppo(config_from_dict(tree), runtime)
    return list(zip(raw, seen, strict=True))


def test_reward_clip_bounds_the_scores_ppo_optimises(
    sft_run, task_env, runtime, tmp_path, monkeypatch, data_cfg
):
    tree = ppo_tree(
        tmp_path / "ppo_clip",
        sft_run.out / "final",
        data_cfg(train=str(task_env.prompts)),
        reward={"function": POSITIVE_REWARD, "clip": 0.1},
        ppo={"iterations": 1, "critic_init": "policy", "ppo_epochs": 1},
    )
    ((raw, used),) = _scores_given_to_shape_rewards(monkeypatch, runtime, tree)
    assert (raw.abs() > 0.1).any(), "precondition: some raw scores lie outside the clip"
    assert used.abs().max() <= 0.1 + 1e-6, used


def test_reward_normalize_changes_the_scores_ppo_optimises(
    sft_run, task_env, runtime, tmp_path, monkeypatch, data_cfg
):
    tree = ppo_tree(
        tmp_path / "ppo_norm",
        sft_run.out / "final",
        data_cfg(train=str(task_env.prompts)),
        reward={"function": POSITIVE_REWARD, "normalize": True},
        ppo={"iterations": 1, "critic_init": "policy", "ppo_epochs": 1},
    )
    ((raw, used),) = _scores_given_to_shape_rewards(monkeypatch, runtime, tree)
    # positive_word_reward takes values in steps of 0.25 with a std of ~0.3; any mean/std
    # normalisation moves them.
    assert raw.std() > 0.05, "precondition: the scores vary"
    assert not torch.allclose(used, raw), "scores reached PPO unnormalised"
