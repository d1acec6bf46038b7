"""PPO for RLHF (docs/architecture.md section 5): rollout -> shaped rewards -> advantages
-> clipped updates. The advantage estimator (ppo.estimator) makes it PPO with GAE, GRPO,
RLOO or REINFORCE++: the same loop, with or without a critic.

Up to four models: actor and critic (trained, one module, one optimizer with a param
group each; no critic for a critic-free estimator), reference (frozen SFT policy) and a
reward model or reward function (frozen).
Every statistic is a token or sequence SUM reduced over all ranks and divided once,
so logged means and the loss do not depend on how batches are split.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time

import torch

from rlhf_dist.algo.estimators import (
    ESTIMATORS,
    AdvantageInputs,
    estimate_advantages,
    estimate_on_masked_tokens,
)
from rlhf_dist.algo.kl import AdaptiveKLController, FixedKLController
from rlhf_dist.algo.masking import RunningMoments, whiten_with
from rlhf_dist.algo.objectives import (
    drop_truncated,
    overlong_penalty,
)
from rlhf_dist.algo.rewards import score_rewards, shape_rewards, token_kl
from rlhf_dist.checkpoint import maybe_fault, rng_state, set_rng_state
from rlhf_dist.config import Config, PPOConfig
from rlhf_dist.config.sizes import old_logprobs_from_update
from rlhf_dist.data.batching import (
    PPOPlan,
    extra_batch,
    global_batches,
    ppo_plan,
)
from rlhf_dist.data.rows import load_data, prompt_set
from rlhf_dist.distributed import Runtime
from rlhf_dist.errors import ConfigError, RewardFunctionError, ServerError
from rlhf_dist.generation import Sampler, make_sampler
from rlhf_dist.models import policy_stop_ids, tokenizer_for
from rlhf_dist.models.lora import merged_adapters
from rlhf_dist.observability.alerts import AlertMonitor
from rlhf_dist.observability.tracking import open_run, write_summary
from rlhf_dist.planning.start import planned_phases, run_hardware
from rlhf_dist.rewards.scoring import check_reward_columns
from rlhf_dist.rollout import PromptBatch, RolloutModels, collect_rollout
from rlhf_dist.rollout.agent import Agent, build_agent
from rlhf_dist.rollout.batch import RolloutBatch, describe_batch
from rlhf_dist.rollout.endpoint import EndpointAgent, endpoint_agent
from rlhf_dist.stats import global_mean_var, global_moments
from rlhf_dist.trainers.common import (
    PreemptionFlag,
    checkpoint_due,
    evaluate_if_due,
    find_resume,
    safe_point,
    write_checkpoint,
)
from rlhf_dist.trainers.dynamic_sampling import rollout_until_full
from rlhf_dist.trainers.online_dpo import PairKnobs, Pairs, online_dpo_update, pair_statistics
from rlhf_dist.trainers.ppo_entropy import cov_choice, make_entropy_controller
from rlhf_dist.trainers.ppo_eval import held_out_eval
from rlhf_dist.trainers.ppo_setup import PPORun, build_models, export_models
from rlhf_dist.trainers.ppo_stats import (
    IterationResult,
    distill_stats,
    due,
    gather_distributions,
    iteration_costs,
    memory_plan_stats,
    overlong_stats,
    report_iteration,
    rollout_stats,
    sample_rows,
    server_stats,
)
from rlhf_dist.trainers.ppo_update import (
    UpdateKnobs,
    UpdateResult,
    ppo_update,
)
from rlhf_dist.trainers.ptx import ptx_stream
from rlhf_dist.trainers.publish import publish


def make_kl_controller(ppo_cfg):
    if ppo_cfg.kl_controller == "adaptive":
        return AdaptiveKLController(ppo_cfg.kl_coef, ppo_cfg.kl_target, ppo_cfg.kl_horizon)
    return FixedKLController(ppo_cfg.kl_coef)


def prompt_stream(
    prompts,
    plan: PPOPlan,
    runtime,
    seed: int,
    pad_id: int,
    skip: int = 0,
    repeat_first: bool = False,
):
    """Yield this rank's (prompt_ids, prompt_mask, texts) per iteration, cycling epochs;
    `skip` iterations are passed over (resume): the order depends only on the seed.
    Each prompt comes n = plan.samples_per_prompt times in a row, so the n samples of a
    prompt (one group) are rows [g*n, (g+1)*n) of ONE rank's rollout: group statistics
    need no collective. repeat_first (debug.overfit_one_batch): the first batch, every
    iteration."""
    n, size = len(prompts.ids), plan.rollout.global_size
    batches = global_batches(n, size, seed, epochs=10**9)
    if repeat_first:
        batches = itertools.repeat(next(batches))
    for _, idx in itertools.islice(batches, skip, None):
        yield rank_prompts(prompts, plan, runtime, idx, pad_id)


def rank_prompts(prompts, plan: PPOPlan, runtime, idx: list[int], pad_id: int) -> PromptBatch:
    """This rank's prompts of the global batch `idx` (ids, mask, texts and the rows' other
    columns), each prompt n times in a row."""
    n = plan.samples_per_prompt
    mine = [i for i in idx[plan.rollout.rank_slice(runtime.rank)] for _ in range(n)]
    return PromptBatch.of(prompts, mine, pad_id, runtime.device)


def extra_prompts(prompts, plan: PPOPlan, runtime, seed: int, pad_id: int, it: int):
    """round -> this rank's prompt batch of dynamic sampling's extra round `round` of
    iteration `it` (batching.extra_batch: a function of seed, it and round, so a resumed
    run draws the same; the main stream is untouched)."""

    def batch(round_: int):
        idx = extra_batch(len(prompts.ids), plan.rollout.global_size, seed, it, round_)
        return rank_prompts(prompts, plan, runtime, idx, pad_id)

    return batch


def normalize_scores(
    runtime, scores: torch.Tensor, moments: RunningMoments, reward_cfg
) -> torch.Tensor:
    """Running normalisation (statistics over all ranks) and clipping of the scores, (B,)."""
    if reward_cfg.normalize:  # RunningMoments folds in population variances
        count, mean, sq_dev = global_moments(runtime, scores)
        moments.update(float(mean), float(sq_dev / count), float(count))
        scores = (scores - moments.mean) / (moments.var + 1e-8) ** 0.5
    if reward_cfg.clip is not None:
        scores = scores.clamp(-reward_cfg.clip, reward_cfg.clip)
    return scores


def sample_rollout(
    runtime, run: PPORun, prompt_batch, cfg, timings: dict, more_prompts=None, old_logprobs=True
):
    """This rank's rollout -> (batch, response texts, prompt texts, statistics), with the
    soft overlong penalty added to the scores (ppo.overlong=soft) and, with
    ppo.dynamic_sampling, tied groups replaced by groups of more prompts (more_prompts:
    round -> prompt batch; trainers/dynamic_sampling.py). old_logprobs=False: scoring skips
    the actor pass (old_logprobs_from_update)."""
    p = cfg.ppo

    def rollout(prompts):
        spent = {}
        with runtime.autocast():  # bf16 compute over fp32 weights, where that is the precision
            batch, texts = collect_rollout(
                run.rollout_models, prompts, cfg, run.tokenizer, spent, old_logprobs=old_logprobs
            )
        for name, seconds in spent.items():
            timings[name] = timings.get(name, 0.0) + seconds
        if p.overlong == "soft":  # DAPO eq. 13 on |y|, the response's token count
            penalty = overlong_penalty(
                batch.response_mask.sum(1), cfg.generation.max_new_tokens, p.overlong_buffer
            )
            batch = dataclasses.replace(batch, scores=batch.scores + penalty.to(batch.scores.dtype))
        return batch, texts

    if not p.dynamic_sampling:
        return (*rollout(prompt_batch), prompt_batch.texts, {})
    n, pad = run.plan.samples_per_prompt, run.tokenizer.pad_token_id
    rounds = p.dynamic_sampling_max_rounds
    return rollout_until_full(runtime, rollout, prompt_batch, more_prompts, n, rounds, pad)


def ppo_iteration(
    runtime: Runtime,
    run: PPORun,
    prompt_batch,
    cfg: Config,
    it: int,
    more_prompts=None,
    planned: dict[str, float] | None = None,
) -> IterationResult:
    """One iteration (docs/architecture.md section 5): rollout (with dynamic sampling:
    refilled) -> scores -> rewards -> advantages (ppo.estimator) -> whitening -> update
    (with ppo.overlong=mask: truncated rows masked out) -> statistics. The rollout batch
    is frozen: each step makes a new one."""
    if cfg.ppo.estimator == "online_dpo":  # the DPO loss on pairs: its own update
        return online_dpo_iteration(runtime, run, prompt_batch, cfg, it, more_prompts)
    p, kl_coef = cfg.ppo, run.kl_ctl.coef
    timings: dict[str, float] = {}
    skip = old_logprobs_from_update(cfg)  # no actor pass in scoring
    t0 = time.time()
    run.model.eval()
    runtime.start_phase_peak()
    batch, texts, prompt_texts, sampling = sample_rollout(
        runtime, run, prompt_batch, cfg, timings, more_prompts, not skip
    )
    measured = {"rollout": runtime.phase_peak_bytes()}
    runtime.start_phase_peak()
    maybe_fault("rollout", it)
    run.scorer.raise_failure(runtime)  # all ranks together, weights untouched
    print_first_batch(runtime, run, cfg, batch, texts)
    t1 = time.time()
    scores = normalize_scores(runtime, batch.scores, run.score_moments, cfg.reward)
    batch = dataclasses.replace(batch, scores=scores)
    rewards, kl = rollout_rewards(batch, kl_coef, p)  # kl None: old log-probs still unknown
    advantages, returns = estimate(p.estimator, batch, rewards, run.plan.samples_per_prompt, p)
    trained, trained_adv, overlong = trained_view(runtime, batch, advantages, cfg)
    chosen, cov_stats = cov_choice(runtime, trained, trained_adv, p, cfg.run.seed, it)
    run.model.train()
    knobs = UpdateKnobs.from_config(cfg, kl_coef, run.group_names, run.entropy_ctl.coef)
    update = ppo_update(runtime, run, trained, trained_adv, returns, knobs, it, chosen)
    measured["update"] = runtime.phase_peak_bytes()
    batch = with_update_logprobs(batch, update)
    if kl is None:  # the update's forward gave the old log-probs: the rollout's KL now
        kl = token_kl(batch.old_logprobs, batch.ref_logprobs, batch.response_mask, p.kl_kind)
    stats = rollout_stats(runtime, batch, kl, advantages, returns, kl_coef) | sampling
    stats |= overlong | cov_stats | run.scorer.component_stats(runtime) | update.stats
    stats |= distill_stats(runtime, batch)  # {} without model.teacher
    stats |= server_stats(runtime, run.rollout_models.sampler)  # {} without rollout servers
    distributions = None
    if due(cfg.run.histogram_every, it):  # a collective: every rank takes part
        distributions = gather_distributions(runtime, batch, advantages, kl)
    stats |= iteration_costs(runtime, run, (t0, t1, time.time()), timings, batch.response_mask, cfg)
    stats |= memory_plan_stats(runtime, planned or {}, measured)
    run.kl_ctl.update(stats["objective/kl"], run.plan.sequences)
    run.entropy_ctl.update(stats["objective/entropy"])  # ppo.entropy_target: next iteration's
    samples = sample_rows(prompt_texts, texts, batch, kl)[: cfg.run.num_samples]
    return IterationResult(stats, distributions, samples)


def online_dpo_iteration(
    runtime: Runtime, run: PPORun, prompt_batch, cfg: Config, it: int, more_prompts=None
) -> IterationResult:
    """One iteration of online DPO (trainers/online_dpo.py, docs/online_dpo.md): rollout
    of n samples per prompt by the current policy (old and reference log-probs, scores) ->
    score normalisation -> each group's best and worst sample as a pair (tied groups
    skipped) -> the DPO update on the pairs -> statistics (the rollout's, the labeller's,
    the update's). The per-token "advantages" logged are the pair labels (+1 / -1 / 0)."""
    timings: dict[str, float] = {}
    t0 = time.time()
    run.model.eval()
    batch, texts, prompt_texts, sampling = sample_rollout(
        runtime, run, prompt_batch, cfg, timings, more_prompts
    )
    maybe_fault("rollout", it)
    run.scorer.raise_failure(runtime)  # all ranks together, weights untouched
    print_first_batch(runtime, run, cfg, batch, texts)
    t1 = time.time()
    scores = normalize_scores(runtime, batch.scores, run.score_moments, cfg.reward)
    batch = dataclasses.replace(batch, scores=scores)
    n, mask = run.plan.samples_per_prompt, batch.response_mask
    labels, _ = estimate("online_dpo", batch, score_rewards(scores, mask), n, cfg.ppo)
    pairs = Pairs.of(scores, n)
    run.model.train()
    update = online_dpo_update(runtime, run, batch, pairs, PairKnobs.from_config(cfg), it)
    kl = token_kl(batch.old_logprobs, batch.ref_logprobs, mask, cfg.ppo.kl_kind)
    stats = rollout_stats(runtime, batch, kl, labels, None, run.kl_ctl.coef) | sampling | update
    stats |= pair_statistics(runtime, batch, pairs) | run.scorer.component_stats(runtime)
    stats |= overlong_stats(runtime, batch, mask, cfg)  # the soft penalty, in the scores
    distributions = None
    if due(cfg.run.histogram_every, it):  # a collective: every rank takes part
        distributions = gather_distributions(runtime, batch, labels, kl)
    stats |= iteration_costs(runtime, run, (t0, t1, time.time()), timings, mask, cfg)
    samples = sample_rows(prompt_texts, texts, batch, kl)[: cfg.run.num_samples]
    return IterationResult(stats, distributions, samples)


def print_first_batch(runtime: Runtime, run: PPORun, cfg: Config, batch, texts) -> None:
    """debug.print_first_batch: the first rollout's rows token by token, once (main)."""
    if cfg.debug.print_first_batch and not run.printed_first_batch and runtime.is_main:
        print(describe_batch(run.tokenizer, batch, texts), flush=True)
        run.printed_first_batch = True


def rollout_rewards(batch: RolloutBatch, kl_coef: float, p: PPOConfig):
    """(rewards (B, T), per-token KL (B, T) or None): with ppo.kl_placement=reward the
    score at the last token minus kl_coef x the KL on every token (InstructGPT); with
    loss the score alone, the KL a loss term (its estimate for the statistics, or None
    while the rollout has no old log-probs: the update's forward gives them)."""
    mask = batch.response_mask
    if p.kl_placement == "reward":
        lp, ref = batch.old_logprobs, batch.ref_logprobs
        return shape_rewards(batch.scores, lp, ref, mask, kl_coef, p.kl_kind)
    kl = None
    if batch.old_logprobs is not None:
        kl = token_kl(batch.old_logprobs, batch.ref_logprobs, mask, p.kl_kind)
    return score_rewards(batch.scores, mask), kl


def estimate(name: str, batch: RolloutBatch, rewards, group_size: int, p: PPOConfig):
    """(advantages, returns or None) of estimator `name` on this rank's rollout. Multi-turn
    episodes: the recursions run over the sampled tokens only, across the tool tokens' gaps
    in the mask (docs/agents.md); single turns as always."""
    inputs = advantage_inputs(rewards, batch, group_size, p)
    if batch.response_attention is None:
        return estimate_advantages(name, inputs)
    return estimate_on_masked_tokens(name, inputs)


def trained_view(runtime: Runtime, batch: RolloutBatch, advantages, cfg: Config):
    """(the rollout as the update sees it, its advantages, overlong statistics): with
    DAPO's overlong filtering (ppo.overlong=mask) truncated responses leave the mask AFTER
    the advantages, which saw whole groups (docs/agents.md, "Objectives"); then whitening
    over all ranks' trained tokens when `whitens`. advantages: (B, T)."""
    p, mask = cfg.ppo, batch.response_mask
    trained_mask = drop_truncated(mask, batch.finished) if p.overlong == "mask" else mask
    overlong = overlong_stats(runtime, batch, trained_mask, cfg)
    if whitens(p):
        moments = global_mean_var(runtime, advantages, trained_mask)
        advantages = whiten_with(advantages, trained_mask, *moments)
    return dataclasses.replace(batch, response_mask=trained_mask), advantages, overlong


def with_update_logprobs(batch: RolloutBatch, update: UpdateResult) -> RolloutBatch:
    """The rollout with the old log-probs and entropies its update's forward computed
    (when scoring skipped the actor pass); without a reference model the reference is the
    old policy itself (KL 0)."""
    if update.old_logprobs is None:
        return batch
    ref = batch.ref_logprobs if batch.ref_logprobs is not None else update.old_logprobs.clone()
    return dataclasses.replace(
        batch, old_logprobs=update.old_logprobs, entropy=update.entropy, ref_logprobs=ref
    )


def advantage_inputs(rewards, batch, group_size: int, ppo_cfg) -> AdvantageInputs:
    """What an estimator reads from a rollout: rewards (B, T) and scores (B,) of B rows."""
    return AdvantageInputs(
        rewards=rewards,
        scores=batch.scores,
        response_mask=batch.response_mask,
        values=batch.old_values,
        group_size=group_size,
        gamma=ppo_cfg.gamma,
        lam=ppo_cfg.lam,
        std_normalize=ppo_cfg.grpo_std_normalize,
    )


def whitens(ppo_cfg) -> bool:
    """ppo.whiten_advantages, or the estimator's own rule where it is null."""
    if ppo_cfg.whiten_advantages is None:
        return ESTIMATORS[ppo_cfg.estimator].traits.whitens
    return ppo_cfg.whiten_advantages


def with_next(stream):
    """(this item, the next one or None) for each item of `stream`."""
    current = next(stream, None)
    while current is not None:
        upcoming = next(stream, None)
        yield current, upcoming
        current = upcoming


def expect_next(cfg: Config, run: PPORun, it: int, upcoming) -> None:
    """ppo.max_staleness (generation/prefetch.py): tell the servers' client which prompts to
    request while iteration `it` trains: none at the last iteration or one that writes a
    scheduled checkpoint, so the iteration after a checkpoint samples on-policy and a
    resumed run samples what the unbroken run did."""
    ahead = upcoming is not None and not checkpoint_due(cfg, it, cfg.ppo.iterations, False)
    run.rollout_models.sampler.expect_next(it, upcoming if ahead else None)


def start_ppo(
    cfg: Config, runtime: Runtime, ckpt, tokenizer, sampler: Sampler | None = None
) -> PPORun:
    """Load data and models (from a checkpoint if resuming) into a PPORun; `sampler`
    samples the rollouts (None: generation.backend's, generation.make_sampler)."""
    p = cfg.ppo
    plan = ppo_plan(p, runtime.world_size)
    # PPO-ptx rows, before any model loads (a data mistake is found first); one global
    # batch of ppo.minibatch_size rows per optimizer step, from where the checkpoint was.
    position = ckpt.trainer.get("ptx_position", 0) if ckpt else 0
    ptx = ptx_stream(cfg, runtime, tokenizer, plan.update, position)
    # The multi-turn agent too (tools resolved, the template checked to show them): None
    # without generation.tools / environment; played through the endpoint with
    # generation.environment_endpoint.
    agent = endpoint_agent(cfg) or build_agent(cfg, tokenizer)
    total_steps = p.iterations * plan.optimizer_steps_per_iteration
    built = build_models(cfg, runtime, plan, total_steps, ckpt)
    model = built.model

    rollout_models = make_rollout_models(cfg, runtime, built, tokenizer, agent, sampler)
    kl_ctl, moments, entropy_ctl = restored_controllers(p, ckpt, built.scheduler)
    return PPORun(
        model,
        built.optimizer,
        built.scheduler,
        rollout_models,
        tokenizer,
        kl_ctl,
        plan,
        moments,
        built.group_names,
        built.scorer,
        cfg.perf.gather_for_training,
        ptx=ptx,
        entropy_ctl=entropy_ctl,
    )


def make_rollout_models(
    cfg: Config, runtime: Runtime, built, tokenizer, agent: Agent | EndpointAgent | None,
    sampler: Sampler | None = None,
) -> RolloutModels:  # fmt: skip
    """What a rollout reads: the actor (generated from through `generation_context`), the
    frozen models, the stop ids, the sampler (None: generation.backend's), the agent and
    the scoring split."""
    model = built.model
    gather = cfg.perf.gather_for_generation
    # LoRA: generate with the adapters folded into the base (whole tensors only: not
    # through ZeRO-3's per-layer gathers).
    merge = cfg.lora.enabled and (runtime.zero_stage != 3 or gather)

    @contextlib.contextmanager
    def generation_context():
        with contextlib.ExitStack() as stack:
            actor, keep_in_step = stack.enter_context(
                runtime.generation_context(model, "actor", gather)
            )
            yield (stack.enter_context(merged_adapters(actor)) if merge else actor), keep_in_step

    stops = policy_stop_ids(cfg, tokenizer)
    if sampler is None:  # generation.backend's (generation/factory.py)
        sampler = make_sampler(cfg, runtime, model, generation_context)
    return RolloutModels(
        model,
        generation_context,
        built.reference,
        built.scorer,
        stops,
        sampler,
        whole_weights=lambda: runtime.whole_weights(model, gather),
        agent=agent,
        any_rank=runtime.any_rank if runtime.world_size > 1 else None,
        perf=cfg.perf,
        teacher=built.teacher,  # model.teacher: scores the rollout (docs/distill.md)
        # distributed.sequence_parallel_size: scoring's forwards split over the group
        pool=runtime.pool_micro_batches if runtime.sequence_parallel_size > 1 else None,
        has_critic=ESTIMATORS[cfg.ppo.estimator].traits.needs_critic,
        split=runtime.sequence_parallel,
    )


def restored_controllers(p, ckpt, scheduler):
    """(KL controller, score moments, entropy controller), restored from the checkpoint
    (the scheduler's position too) when resuming."""
    kl_ctl, moments = make_kl_controller(p), RunningMoments()
    entropy_ctl = make_entropy_controller(p)
    if ckpt:
        kl_ctl.load_state_dict(ckpt.trainer["kl_controller"])
        if "entropy_controller" in ckpt.trainer:  # absent from checkpoints written before it
            entropy_ctl.load_state_dict(ckpt.trainer["entropy_controller"])
        moments.load_state_dict(ckpt.trainer["score_moments"])
        scheduler.load_state_dict(ckpt.trainer["scheduler"])
    return kl_ctl, moments, entropy_ctl


def trainer_state(run: PPORun, first_score: float | None, alerts: AlertMonitor) -> dict:
    """Everything besides weights and optimizer that a resumed run must continue from."""
    return {
        "kl_controller": run.kl_ctl.state_dict(),
        "entropy_controller": run.entropy_ctl.state_dict(),
        "score_moments": run.score_moments.state_dict(),
        "scheduler": run.scheduler.state_dict(),
        "first_score": first_score,
        "alerts": alerts.state_dict(),
        "ptx_position": run.ptx.position if run.ptx is not None else 0,  # batches drawn
    }


def stop_on_failure(cfg, runtime, run_files, run: PPORun, done, state, error):
    """The error to end the run with after the reward failed (RewardFunctionError, retries
    spent) or a rollout server did (ServerError) in the iteration after `done`; raised on
    every rank together (retry.py; generation/server.py agrees over the ranks).

    run_files: (output dir, MetricsLogger); done: (last completed iteration, the RNG
    states at its end); state: trainer_state. The failed iteration's rollout changed no
    weights, optimizer or trainer state, so with its RNG put back the checkpoint written
    at `done` is the one the unbroken run would have written there: `--resume auto`
    continues bitwise (docs/architecture.md section 7). With nothing completed (done 0)
    there is nothing to keep, and the run directory is removed, as for any user mistake.
    """
    (out, logger), (step, rng) = run_files, done
    if step == 0:
        logger.discard()
        return error
    set_rng_state(rng)
    write_checkpoint(cfg, runtime, out, step, run.model, run.optimizer, state)
    logger.close()
    fix = "fix the reward" if isinstance(error, RewardFunctionError) else "restart the server"
    return type(error)(
        f"{error}; iteration {step} and all before it are checkpointed in "
        f"{out / 'checkpoints'}: {fix}, then continue with --resume auto"
    )


def train_ppo(cfg, runtime, sampler: Sampler | None = None) -> dict:
    """Run PPO as configured; returns the summary written to summary.json. `sampler`
    samples the rollouts (None: generation.backend's; any generation.Sampler)."""
    ckpt, p = find_resume(cfg, runtime), cfg.ppo
    tokenizer = tokenizer_for(cfg, "policy")
    prompts = training_prompts(cfg, tokenizer)  # data mistakes before any model loads
    run = start_ppo(cfg, runtime, ckpt, tokenizer, sampler)
    out, logger = open_run(cfg, runtime, "ppo", ckpt, p.iterations)
    runtime.print(prompts.report.summary("prompts"))
    start = ckpt.step if ckpt else 0
    runtime.seed_per_rank(cfg.run.seed)
    if ckpt:
        ckpt.restore_rng(cfg.run.seed)
    pad = run.tokenizer.pad_token_id
    overfit = cfg.debug.overfit_one_batch
    stream = prompt_stream(prompts, run.plan, runtime, cfg.run.seed, pad, start, overfit)
    first_score = ckpt.trainer["first_score"] if ckpt else None
    preemption, alerts, stats = PreemptionFlag(), AlertMonitor(cfg.alerts), {}
    if ckpt:  # alerts judge "since the start" of the run, not of this process
        alerts.load_state_dict(ckpt.trainer.get("alerts"))
    evaluate = held_out_eval(cfg, runtime, run)  # run.eval_every; None: no evaluation
    planned = planned_phases(cfg, "ppo", run_hardware(runtime))  # memory/planned_* metrics
    for it, (prompt_batch, upcoming) in zip(range(start + 1, p.iterations + 1), with_next(stream)):
        rng = rng_state()  # as the checkpoint of iteration it - 1 holds it
        expect_next(cfg, run, it, upcoming)  # ppo.max_staleness: what to request ahead
        more = extra_prompts(prompts, run.plan, runtime, cfg.run.seed, pad, it)
        try:
            result = ppo_iteration(runtime, run, prompt_batch, cfg, it, more, planned)
        except (RewardFunctionError, ServerError) as e:
            run.rollout_models.sampler.close()  # a rollout in flight is not waited for
            state = trainer_state(run, first_score, alerts)
            failure = stop_on_failure(cfg, runtime, (out, logger), run, (it - 1, rng), state, e)
            raise failure from e.__cause__
        stats = result.stats
        first_score = stats["objective/score"] if first_score is None else first_score
        report_iteration(logger, cfg, it, result, alerts)
        steps, trained = (it, p.iterations), (run.model, run.optimizer)
        safe_point(
            cfg, runtime, out, steps, preemption, trained, trainer_state(run, first_score, alerts)
        )
        evaluate_if_due(cfg, runtime, logger, steps, evaluate)
    export_models(cfg, runtime, run.model, run.tokenizer, out)
    summary = {
        "iterations": p.iterations,
        "score": stats.get("objective/score"),
        "kl": stats.get("objective/kl"),
        "first_score": first_score,
        "episodes": p.iterations * p.rollout_batch_size,
    }
    write_summary(runtime, out, summary)
    logger.close()
    publish(cfg, runtime, out, "ppo", summary)
    return summary


def training_prompts(cfg: Config, tokenizer):
    """data.train's usable prompts (`data.prompt_set`), at least one rollout batch of them,
    whose columns every reward function that names one finds (check_reward_columns)."""
    d, p = cfg.data, cfg.ppo
    prompts = prompt_set(load_data(d, "train"), tokenizer, d, f"data.train {d.train!r}")
    if len(prompts.ids) < p.rollout_batch_size:
        raise ConfigError(
            f"ppo.rollout_batch_size: {p.rollout_batch_size} is more than the {len(prompts.ids)} usable prompts"
        )
    columns = {name for row in prompts.columns for name in row}
    check_reward_columns(cfg.reward, columns, f"data.train {d.train!r}")
    return prompts
