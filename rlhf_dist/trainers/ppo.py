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
import functools
import itertools
import time
from dataclasses import dataclass

import torch

from rlhf_dist.algo.estimators import (
    ESTIMATORS,
    AdvantageInputs,
    estimate_advantages,
    estimate_on_masked_tokens,
)
from rlhf_dist.algo.kl import AdaptiveKLController, FixedKLController, kl_estimate
from rlhf_dist.algo.losses import (
    aggregation_count,
    aggregation_weights,
    ppo_policy_terms,
    truncated_is_weights,
    value_terms,
)
from rlhf_dist.algo.masking import RunningMoments, masked_sum, whiten_with
from rlhf_dist.algo.objectives import (
    cispo_terms,
    drop_truncated,
    overlong_penalty,
    sequence_log_ratio,
)
from rlhf_dist.algo.rewards import shape_rewards
from rlhf_dist.checkpoint import maybe_fault, rng_state, set_rng_state
from rlhf_dist.data.batching import (
    BatchPlan,
    PPOPlan,
    extra_batch,
    global_batches,
    ppo_plan,
    token_budget_split,
)
from rlhf_dist.data.chat import prompt_text
from rlhf_dist.data.rows import left_pad, load_rows, prompt_set
from rlhf_dist.errors import ConfigError, RewardFunctionError
from rlhf_dist.models import policy_stop_ids, tokenizer_for
from rlhf_dist.models.lora import merged_adapters
from rlhf_dist.observability.alerts import AlertMonitor
from rlhf_dist.observability.tracking import open_run, write_summary
from rlhf_dist.rollout import RolloutModels, collect_rollout
from rlhf_dist.rollout.agent import build_agent, episode_stats
from rlhf_dist.rollout.batch import describe_batch
from rlhf_dist.rollout.vllm import VLLMEngine
from rlhf_dist.stats import StatSums, global_mean_var, global_moments
from rlhf_dist.trainers.common import (
    PreemptionFlag,
    find_resume,
    padding_cells,
    safe_point,
    share_of_global_mean,
    step_and_schedule,
    write_checkpoint,
)
from rlhf_dist.trainers.dynamic_sampling import rollout_until_full
from rlhf_dist.trainers.ppo_setup import build_models, export_models
from rlhf_dist.trainers.ptx import PtxStream, ptx_stream


def make_kl_controller(ppo_cfg):
    if ppo_cfg.kl_controller == "adaptive":
        return AdaptiveKLController(ppo_cfg.kl_coef, ppo_cfg.kl_target, ppo_cfg.kl_horizon)
    return FixedKLController(ppo_cfg.kl_coef)


@dataclass(frozen=True)
class UpdateKnobs:
    """The numbers a PPO update reads: loss knobs (ppo.*), the sampling temperature the
    new log-probs must use, the KL coefficient when KL is a loss term (0 when it is a
    reward penalty), and one gradient-norm limit per optimizer param group."""

    temperature: float
    clip_eps_low: float | None  # ppo.clip_eps_low, else ppo.clip_eps; None: clipping off
    clip_eps_high: float | None  # ppo.clip_eps_high, else ppo.clip_eps
    dual_clip: float | None
    value_clip_eps: float | None
    vf_coef: float
    entropy_coef: float
    kl_loss_coef: float
    kl_kind: str
    loss_aggregation: str
    max_grad_norms: tuple[float, ...]
    tis_cap: float | None = None  # truncated IS weights against vLLM's sampler; None: off
    ratio_level: str = "token"  # token (PPO) or sequence (GSPO)
    policy_loss: str = "clip"  # clip (PPO) or cispo

    @classmethod
    def from_config(cls, cfg, kl_coef=None, group_names=("actor", "critic")) -> UpdateKnobs:
        """kl_coef: the KL controller's current value (None: ppo.kl_coef)."""
        p = cfg.ppo
        kl_coef = p.kl_coef if kl_coef is None else kl_coef
        low = p.clip_eps if p.clip_eps_low is None else p.clip_eps_low
        high = p.clip_eps if p.clip_eps_high is None else p.clip_eps_high
        kl_loss_coef = kl_coef if p.kl_placement == "loss" else 0.0
        optim = {"actor": p.optim, "critic": p.critic_optim}  # param group -> its section
        norms = tuple(optim[name].max_grad_norm for name in group_names)
        return cls(
            cfg.generation.temperature, low, high, p.dual_clip, p.value_clip_eps, p.vf_coef,
            p.entropy_coef, kl_loss_coef, p.kl_kind, p.loss_aggregation, norms, p.tis_cap,
            ratio_level=p.ratio_level, policy_loss=p.policy_loss,
        )  # fmt: skip


def micro_batch_loss(
    model, mb, advantages, returns, knobs: UpdateKnobs, stats, keep=None
) -> torch.Tensor:
    """Weighted token SUM of one micro-batch's loss (the caller divides by the global
    count of tokens or sequences, per knobs.loss_aggregation): the clipped policy loss,
    plus vf_coef x the value loss with a critic, kl_loss_coef x the KL to the reference
    when KL is a loss term, minus entropy_coef x the entropy.

    mb: a RolloutBatch (B rows, T response columns); advantages: (B, T); returns: (B, T)
    or None without a critic; stats: a StatSums the loss statistics are added to. When
    mb.old_logprobs is None (`old_logprobs_from_update`), this forward's log-probs,
    detached, are the old ones (ratio exactly 1) and keep(old_logprobs, entropy) gets
    them, each (B, T).
    """
    first = mb.old_logprobs is None
    logprobs, entropy, values = model(
        mb.input_ids, mb.attention_mask, mb.response_mask, knobs.temperature,
        bool(knobs.entropy_coef) or first,
    )  # fmt: skip
    old_logprobs = logprobs.detach() if first else mb.old_logprobs
    if first:
        keep(old_logprobs, entropy.detach())
    pg = policy_terms(logprobs, old_logprobs, mb.response_mask, advantages, knobs)
    mask = mb.response_mask
    n = mask.sum()
    if knobs.tis_cap is not None:  # the rollout came from vLLM's sampler, not pi_old
        weights = truncated_is_weights(old_logprobs, mb.sampler_logprobs, knobs.tis_cap)
        pg["loss"] = weights * pg["loss"]
        stats.add("policy/tis_capped_frac", masked_sum((weights >= knobs.tis_cap).float(), mask), n)
    per_token, named = pg["loss"], [("policy", pg)]
    if values is not None:
        vf = value_terms(values, mb.old_values, returns, knobs.value_clip_eps)
        per_token = per_token + knobs.vf_coef * vf["loss"]
        named.append(("value", vf))
    if knobs.kl_loss_coef:
        kl = kl_estimate(logprobs, mb.ref_logprobs, knobs.kl_kind)
        per_token = per_token + knobs.kl_loss_coef * kl
        stats.add("policy/kl_loss", masked_sum(kl.detach(), mask), n)
    if knobs.entropy_coef:
        per_token = per_token - knobs.entropy_coef * entropy
        stats.add("policy/entropy", masked_sum(entropy.detach(), mask), n)
    for prefix, terms in named:
        stats.add(f"{prefix}/loss", masked_sum(terms["loss"].detach(), mask), n)
        stats.add(f"{prefix}/clipfrac", masked_sum(terms["clipped"].detach(), mask), n)
    stats.add("policy/approx_kl", masked_sum(pg["approx_kl"], mask), n)
    stats.add("policy/ratio_mean", masked_sum(pg["ratio"], mask), n)
    stats.add_max("policy/ratio_max", torch.where(mask, pg["ratio"], 0.0).max())
    weights = aggregation_weights(mask, knobs.loss_aggregation, per_token.dtype)
    return masked_sum(weights * per_token, mask)


def policy_terms(logprobs, old_logprobs, response_mask, advantages, knobs: UpdateKnobs) -> dict:
    """Per-token policy terms (B, T) of knobs.policy_loss (clip: PPO's surrogate; cispo)
    with knobs.ratio_level's ratio (token; sequence: GSPO's, from each row's own tokens,
    which a micro-batch always holds whole). docs/architecture.md section 4."""
    log_ratio = None
    if knobs.ratio_level == "sequence":
        log_ratio = sequence_log_ratio(logprobs, old_logprobs, response_mask)
    low = float("inf") if knobs.clip_eps_low is None else knobs.clip_eps_low
    if knobs.policy_loss == "cispo":
        high = low if knobs.clip_eps_high is None else knobs.clip_eps_high
        return cispo_terms(logprobs, old_logprobs, advantages, low, high, log_ratio)
    return ppo_policy_terms(
        logprobs, old_logprobs, advantages, low, knobs.clip_eps_high, knobs.dual_clip, log_ratio
    )


def minibatch_backward(
    runtime, model, mb, advantages, returns, knobs, slices, stats, keep=None, ptx=None
) -> None:
    """Accumulate the gradient of one optimizer step over this rank's micro-batches.

    mb: this rank's share of the global minibatch; slices: its micro-batches. Each
    micro-batch's loss SUM is divided by the count (response tokens or sequences, per
    knobs.loss_aggregation) of the WHOLE global minibatch (share_of_global_mean).
    keep(s, old_logprobs, entropy): where a micro-batch without old log-probs puts them.
    ptx: the PtxStream with PPO-ptx on (InstructGPT eq. 2): the step's ptx batch, in as
    many micro-batches, adds ptx_coef x its global token-mean NLL (trainers/ptx.py), each
    ptx micro-batch with its own forward and backward before PPO micro-batch i's, so the
    step's last backward is PPO's (every parameter gets its gradient there) and each
    forward is followed by its backward, as DeepSpeed's ZeRO-3 hooks require.
    """
    count = runtime.all_sum(aggregation_count(mb.response_mask, knobs.loss_aggregation))
    count = count.clamp(min=1.0)  # ppo.overlong=mask can leave a minibatch without tokens
    ptx_step = None if ptx is None else ptx.next_step(runtime, len(slices))
    for i, s in enumerate(slices):
        if ptx_step is not None:  # + ptx_coef x micro-batch i's share of the ptx token mean
            with runtime.accumulating(model):  # its forward leaves the critic unused
                runtime.micro_backward(model, ptx_step.loss(runtime, model, i, stats), last=False)
        micro, T = mb.select(s).trimmed()  # columns that are padding in every row cost nothing
        stats.add("update/pad_fraction", *padding_cells(micro.attention_mask))
        adv = advantages[s][:, :T]
        ret = None if returns is None else returns[s][:, :T]
        keep_micro = None if keep is None else functools.partial(keep, s)
        loss_sum = micro_batch_loss(model, micro, adv, ret, knobs, stats, keep_micro)
        loss = share_of_global_mean(runtime, loss_sum, count)
        runtime.micro_backward(model, loss, last=i == len(slices) - 1)


def update_micro_batches(runtime, mb, plan: BatchPlan) -> list:
    """The micro-batches of this rank's share `mb` of a minibatch: `plan.micro_slices()`,
    or with ppo.micro_batch_tokens index tensors from `batching.token_budget_split` of
    each row's (prompt, response) length, the widths `RolloutBatch.trimmed` keeps, into
    as many micro-batches as the busiest rank needs (one all-max: under ZeRO-3 every
    forward/backward is a collective). A function of the rows, so of the seed."""
    if not plan.micro_batch_tokens:
        return plan.micro_slices()
    prompt, response = mb.prompt_mask.sum(1), mb.response_mask.sum(1).clamp(min=1)
    widths = torch.stack([prompt, response], dim=1).tolist()
    budget = plan.micro_batch_tokens
    mine = len(token_budget_split(widths, budget))
    parts = int(runtime.all_max(torch.tensor(mine, dtype=torch.long, device=runtime.device)))
    groups = token_budget_split(widths, budget, parts)
    return [torch.tensor(g, dtype=torch.long, device=mb.response_mask.device) for g in groups]


def ppo_update(runtime, run, batch, advantages, returns, knobs: UpdateKnobs, it: int = 0) -> dict:
    """ppo_epochs passes over this rank's rollout in minibatches; returns reduced stats."""
    stats, plan = StatSums(), run.plan
    per_rank = plan.update.per_rank
    trained = (run.model, run.optimizer, run.scheduler)
    record = None  # scoring skipped the actor: old log-probs from the first forward here
    if batch.old_logprobs is None:
        if plan.optimizer_steps_per_iteration != 1:
            raise ValueError("a rollout without old log-probs gets exactly one optimizer step")
        record = UpdateForwardRecord(batch)
    # ZeRO-3: the weights gathered whole once per optimizer step when a copy fits.
    with runtime.training_weights(run.model, run.gather_for_training, "actor-critic"):
        for _ in range(plan.ppo_epochs):
            order = torch.randperm(batch.response_ids.shape[0], device=batch.response_ids.device)
            for start in range(0, order.numel(), per_rank):
                idx = order[start : start + per_rank]
                mb, ret = batch.select(idx), None if returns is None else returns[idx]
                keep = None if record is None else functools.partial(record.keep, idx)
                slices = update_micro_batches(runtime, mb, plan.update)
                minibatch_backward(
                    runtime, run.model, mb, advantages[idx], ret, knobs, slices, stats, keep,
                    run.ptx,
                )  # fmt: skip
                norms = step_and_schedule(runtime, trained, list(knobs.max_grad_norms))
                for name, norm in zip(run.group_names, norms or ()):
                    stats.add(f"optim/grad_norm_{name}", norm, 1)
                maybe_fault("update", it)  # killed with the weights half-way through an iteration
    if record is not None:
        record.fill(batch)
    return stats.reduce(runtime)


def old_logprobs_from_update(cfg, plan: PPOPlan) -> bool:
    """Whether the rollout's scoring skips its actor pass (docs/architecture.md section 10,
    "no redundant forwards"): with ONE optimizer step per rollout (ppo_epochs = 1, one
    minibatch) pi_old is the policy of the update's forward, so its log-probs, detached,
    are the old log-probs (ratio exactly 1, as TRL does). Nothing before the update may
    need them: the KL must be a loss term (with kl_placement=reward the rewards read
    them). The critic, reference and scorer passes still run in scoring; the statistics
    that read old log-probs and entropies (objective/kl, objective/entropy, the vLLM
    sampler gap) are taken after the update. Not with ppo.dynamic_sampling (its refill
    joins rollouts) or ppo.overlong=mask (the update never sees a truncated row's tokens,
    so it could not give their old log-probs)."""
    p = cfg.ppo
    return (
        cfg.perf.old_logprobs_from_update
        and plan.optimizer_steps_per_iteration == 1
        and p.kl_placement == "loss"
        and not p.dynamic_sampling
        and p.overlong != "mask"
    )


class UpdateForwardRecord:
    """Old log-probs and entropies (B, T) of a rollout, gathered from the update's
    micro-batches (rows in shuffled order, columns trimmed) when scoring skipped them."""

    def __init__(self, batch):
        mask = batch.response_mask
        self.logprobs = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        self.entropy = torch.zeros_like(self.logprobs)

    def keep(self, idx, s: slice, logprobs: torch.Tensor, entropy: torch.Tensor) -> None:
        """Micro-batch `s` of the minibatch holding rollout rows `idx`; (b, T') each."""
        rows, T = idx[s], logprobs.shape[1]
        self.logprobs[rows, :T] = logprobs.to(self.logprobs.dtype)
        self.entropy[rows, :T] = entropy.to(self.entropy.dtype)

    def fill(self, batch) -> None:
        batch.old_logprobs, batch.entropy = self.logprobs, self.entropy
        if batch.ref_logprobs is None:  # no reference model: KL 0
            batch.ref_logprobs = self.logprobs.clone()


def rollout_stats(runtime, batch, kl, advantages, returns, kl_coef: float) -> dict:
    """Objective, rollout-shape and value statistics over all ranks' sequences."""
    s = StatSums()
    mask = batch.response_mask
    B, lengths = mask.shape[0], mask.sum(1).float()
    seq_kl = kl.sum(1)
    for name, per_seq in (
        ("objective/score", batch.scores),
        ("objective/raw_score", batch.raw_scores),
        ("objective/kl", seq_kl),
        ("objective/rlhf_reward", batch.scores - kl_coef * seq_kl),
        ("rollout/length", lengths),
        ("rollout/eos_rate", batch.finished.float()),
    ):
        s.add(name, per_seq.sum(), B)
    s.add("objective/entropy", masked_sum(batch.entropy, mask), mask.sum())
    s.add("rollout/pad_fraction", *padding_cells(batch.attention_mask))
    named = [("advantages/raw", advantages)]
    if returns is not None:
        named += [("value/returns", returns), ("value/values", batch.old_values)]
        residual_sq = masked_sum((returns - batch.old_values) ** 2, mask)
        s.add("value/residual_sq", residual_sq, mask.sum())
    for name, x in named:
        s.add(name, masked_sum(x, mask), mask.sum())
    if batch.sampler_logprobs is not None:  # vLLM sampled: how far its probabilities are
        gap = batch.old_logprobs - batch.sampler_logprobs  # log pi_old - log pi_vllm, (B, T)
        s.add("rollout/sampler_logprob_absdiff", masked_sum(gap.abs(), mask), mask.sum())
        # KL(pi_vllm || pi_old), k3 estimate on the tokens vLLM sampled
        sampler_kl = kl_estimate(batch.sampler_logprobs, batch.old_logprobs, "k3")
        s.add("rollout/sampler_kl", masked_sum(sampler_kl, mask), mask.sum())
    if batch.turns is not None:  # multi-turn: turns, tool calls, errors, truncations
        for name, (total, count) in episode_stats(batch).items():
            s.add(name, total, count)
    s.add_max("rollout/length_max", lengths.max())
    s.add_max("rollout/length_min_neg", -lengths.min())
    out = s.reduce(runtime)
    out["rollout/sequences"] = float(runtime.all_sum(torch.tensor(float(B), dtype=torch.float64)))
    out["rollout/length_min"] = -out.pop("rollout/length_min_neg")
    out["objective/score_std"] = _population_var(runtime, batch.scores) ** 0.5
    out["advantages/raw_std"] = _population_var(runtime, advantages, mask) ** 0.5
    if returns is not None:
        returns_var = _population_var(runtime, returns, mask)
        # Explained variance 1 - Var(R - V)/Var(R): 1 = the critic predicts returns perfectly.
        residual = out.pop("value/residual_sq")
        out["value/explained_variance"] = 1.0 - residual / max(returns_var, 1e-12)
    return out


def _population_var(runtime, x: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """Variance over all ranks, divided by n (stats.global_moments)."""
    count, _, sq_dev = global_moments(runtime, x, mask)
    return float(sq_dev / count.clamp(min=1))


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


def rank_prompts(prompts, plan: PPOPlan, runtime, idx: list[int], pad_id: int):
    """This rank's (prompt_ids, prompt_mask, texts) of the global batch `idx`, each prompt
    n times in a row."""
    n = plan.samples_per_prompt
    mine = [i for i in idx[plan.rollout.rank_slice(runtime.rank)] for _ in range(n)]
    ids, mask = left_pad([prompts.ids[i] for i in mine], pad_id)
    return ids.to(runtime.device), mask.to(runtime.device), [prompts.texts[i] for i in mine]


def extra_prompts(prompts, plan: PPOPlan, runtime, seed: int, pad_id: int, it: int):
    """round -> this rank's prompt batch of dynamic sampling's extra round `round` of
    iteration `it` (batching.extra_batch: a function of seed, it and round, so a resumed
    run draws the same; the main stream is untouched)."""

    def batch(round_: int):
        idx = extra_batch(len(prompts.ids), plan.rollout.global_size, seed, it, round_)
        return rank_prompts(prompts, plan, runtime, idx, pad_id)

    return batch


@dataclass
class PPORun:
    """The live objects of a PPO run (what one iteration reads and updates)."""

    model: torch.nn.Module
    optimizer: object
    scheduler: object
    rollout_models: RolloutModels
    tokenizer: object
    kl_ctl: object
    plan: PPOPlan
    score_moments: RunningMoments
    group_names: tuple[str, ...]  # the optimizer's param groups, e.g. ("actor", "critic")
    gather_for_training: str = "auto"  # perf.gather_for_training
    printed_first_batch: bool = False
    ptx: PtxStream | None = None  # PPO-ptx's SFT rows (ppo.ptx_coef > 0), trainers/ptx.py


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


@dataclass
class IterationResult:
    stats: dict
    distributions: dict | None  # name -> values gathered from all ranks (when due)
    samples: list  # this rank's first few (prompt, response, score, kl) rows


def due(every: int, it: int) -> bool:
    return every > 0 and it % every == 0


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
                run.rollout_models, *prompts, cfg, run.tokenizer, spent, old_logprobs=old_logprobs
            )
        for name, seconds in spent.items():
            timings[name] = timings.get(name, 0.0) + seconds
        if p.overlong == "soft":  # DAPO eq. 13 on |y|, the response's token count
            penalty = overlong_penalty(
                batch.response_mask.sum(1), cfg.generation.max_new_tokens, p.overlong_buffer
            )
            batch.scores = batch.scores + penalty.to(batch.scores.dtype)
        return batch, texts

    if not p.dynamic_sampling:
        return (*rollout(prompt_batch), prompt_batch[2], {})
    n, pad = run.plan.samples_per_prompt, run.tokenizer.pad_token_id
    rounds = p.dynamic_sampling_max_rounds
    return rollout_until_full(runtime, rollout, prompt_batch, more_prompts, n, rounds, pad)


def overlong_stats(runtime, batch, trained_mask, cfg) -> dict:
    """Share of sequences left out of the loss (ppo.overlong=mask) and the mean soft
    penalty (ppo.overlong=soft) over all ranks; trained_mask (B, T): the response_mask
    the update sees."""
    p, s = cfg.ppo, StatSums()
    B = batch.response_mask.shape[0]
    if p.overlong == "mask":
        s.add("rollout/overlong_masked_rate", (~trained_mask.any(1)).float().sum(), B)
    if p.overlong == "soft":
        lengths = batch.response_mask.sum(1)
        penalty = overlong_penalty(lengths, cfg.generation.max_new_tokens, p.overlong_buffer)
        s.add("objective/overlong_penalty", penalty.sum(), B)
    return s.reduce(runtime) if p.overlong != "none" else {}


def ppo_iteration(
    runtime, run: PPORun, prompt_batch, cfg, it: int, more_prompts=None
) -> IterationResult:
    """One iteration: rollout (with dynamic sampling: refilled), shaped rewards, advantages
    (ppo.estimator), whitening, update (with ppo.overlong=mask: truncated rows masked out)."""
    p, kl_coef, timings = cfg.ppo, run.kl_ctl.coef, {}
    skip = old_logprobs_from_update(cfg, run.plan)  # no actor pass in scoring
    t0 = time.time()
    run.model.eval()
    batch, texts, prompt_texts, sampling = sample_rollout(
        runtime, run, prompt_batch, cfg, timings, more_prompts, not skip
    )
    maybe_fault("rollout", it)
    run.rollout_models.scorer.raise_failure(runtime)  # all ranks together, weights untouched
    if cfg.debug.print_first_batch and not run.printed_first_batch and runtime.is_main:
        print(describe_batch(run.tokenizer, batch, texts), flush=True)
        run.printed_first_batch = True
    t1 = time.time()
    mask = batch.response_mask
    batch.scores = normalize_scores(runtime, batch.scores, run.score_moments, cfg.reward)
    reward_kl_coef = kl_coef if p.kl_placement == "reward" else 0.0
    # With the skip the KL is not in the rewards (coefficient 0): any log-probs do here.
    old = batch.ref_logprobs if skip else batch.old_logprobs
    rewards, kl = shape_rewards(
        batch.scores, old, batch.ref_logprobs, mask, reward_kl_coef, p.kl_kind
    )
    # Multi-turn episodes: the recursions run over the sampled tokens only, across the
    # tool tokens' gaps in the mask (docs/agents.md); single turns as always.
    estimate = (
        estimate_advantages if batch.response_attention is None else estimate_on_masked_tokens
    )
    advantages, returns = estimate(
        p.estimator, advantage_inputs(rewards, batch, run.plan.samples_per_prompt, p)
    )
    raw_advantages = advantages
    advantages, batch.response_mask, overlong = trained_advantages(runtime, batch, advantages, cfg)
    run.model.train()
    knobs = UpdateKnobs.from_config(cfg, kl_coef, run.group_names)
    update_stats = ppo_update(runtime, run, batch, advantages, returns, knobs, it)
    batch.response_mask = mask  # the rollout as sampled, for its statistics
    if skip:  # the update's forward gave the old log-probs: the KL of the rollout now
        _, kl = shape_rewards(
            batch.scores, batch.old_logprobs, batch.ref_logprobs, mask, 0.0, p.kl_kind
        )
    # Taken after the update, which leaves the rollout and the raw advantages as they were.
    stats = rollout_stats(runtime, batch, kl, raw_advantages, returns, kl_coef) | sampling
    stats |= overlong | run.rollout_models.scorer.component_stats(runtime)
    distributions = None
    if due(cfg.run.histogram_every, it):  # a collective: every rank takes part
        distributions = gather_distributions(runtime, batch, raw_advantages, kl)
    stats |= update_stats
    stats |= iteration_costs(runtime, run, (t0, t1, time.time()), timings, mask, cfg)
    run.kl_ctl.update(stats["objective/kl"], run.plan.sequences)
    samples = sample_rows(prompt_texts, texts, batch, kl)[: cfg.run.num_samples]
    return IterationResult(stats, distributions, samples)


def trained_advantages(runtime, batch, advantages, cfg):
    """(advantages, trained_mask, overlong statistics) the update sees: with DAPO's overlong
    filtering (ppo.overlong=mask) truncated responses leave the mask AFTER the advantages,
    which saw whole groups (docs/agents.md, "Objectives"); then whitening over all ranks'
    trained tokens when `whitens`. advantages, trained_mask: (B, T)."""
    p, mask = cfg.ppo, batch.response_mask
    trained_mask = drop_truncated(mask, batch.finished) if p.overlong == "mask" else mask
    overlong = overlong_stats(runtime, batch, trained_mask, cfg)
    if whitens(p):
        moments = global_mean_var(runtime, advantages, trained_mask)
        advantages = whiten_with(advantages, trained_mask, *moments)
    return advantages, trained_mask, overlong


def sample_rows(prompt_texts, texts, batch, kl) -> list[dict]:
    """The samples table's rows: prompt (conversations as readable text), response, score,
    the response's summed KL (kl: (B, T) per-token)."""
    prompts = [prompt_text(p) for p in prompt_texts]
    rows = zip(prompts, texts, batch.scores.tolist(), kl.sum(1).tolist())
    return [{"prompt": a, "response": b, "score": c, "kl": d} for a, b, c, d in rows]


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
        return ESTIMATORS[ppo_cfg.estimator].whitens
    return ppo_cfg.whiten_advantages


def gather_distributions(runtime, batch, advantages, kl) -> dict:
    """Every rank's advantages, KL, scores and lengths, for histograms (a collective)."""
    mask = batch.response_mask
    named = {
        "advantages": advantages[mask],
        "kl": kl[mask],
        "scores": batch.scores,
        "length": mask.sum(1),
    }
    return {k: torch.tensor(runtime.gather_objects(v.float().tolist())) for k, v in named.items()}


def iteration_costs(runtime, run: PPORun, times, timings: dict, mask, cfg) -> dict:
    """Time, throughput and peak memory of an iteration (throughput over all ranks)."""
    t0, t1, t2 = times
    tokens = float(runtime.all_sum(mask.sum().double()))
    peak = float(runtime.all_max(torch.tensor(float(runtime.peak_memory_bytes()))))
    return {
        "optim/kl_coef": run.kl_ctl.coef,
        "optim/lr_actor": run.scheduler.get_last_lr()[0],
        "time/generate": timings.get("generate", 0.0),
        "time/score": timings.get("score", 0.0),
        "time/rollout": t1 - t0,
        "time/update": t2 - t1,
        "time/total": t2 - t0,
        "throughput/response_tokens_per_s": tokens / (t2 - t0),
        "throughput/samples_per_s": run.plan.sequences / (t2 - t0),
        "memory/peak_gib": peak / 2**30,
        "guard/skipped_steps": runtime.skipped_steps,
    }


CONSOLE_KEYS = (
    "objective/score",
    "objective/kl",
    "objective/entropy",
    "rollout/length",
    "policy/clipfrac",
    "value/explained_variance",
)


def start_ppo(cfg, runtime, ckpt) -> PPORun:
    """Load data and models (from a checkpoint if resuming) into a PPORun."""
    p = cfg.ppo
    tokenizer = tokenizer_for(cfg, "policy")
    plan = ppo_plan(p, runtime.world_size)
    # PPO-ptx rows, before any model loads (a data mistake is found first); one global
    # batch of ppo.minibatch_size rows per optimizer step, from where the checkpoint was.
    position = ckpt.trainer.get("ptx_position", 0) if ckpt else 0
    ptx = ptx_stream(cfg, runtime, tokenizer, plan.update, position)
    total_steps = p.iterations * plan.optimizer_steps_per_iteration
    built = build_models(cfg, runtime, plan, total_steps, ckpt)
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
    engine = VLLMEngine(cfg, runtime.device) if cfg.generation.backend == "vllm" else None
    rollout_models = RolloutModels(
        model,
        generation_context,
        built.reference,
        built.scorer,
        stops,
        engine,
        whole_weights=lambda: runtime.whole_weights(model, gather),
        agent=build_agent(cfg, tokenizer),  # None without generation.tools / environment
        any_rank=runtime.any_rank if runtime.world_size > 1 else None,
        perf=cfg.perf,
    )
    kl_ctl, moments = make_kl_controller(p), RunningMoments()
    if ckpt:
        kl_ctl.load_state_dict(ckpt.trainer["kl_controller"])
        moments.load_state_dict(ckpt.trainer["score_moments"])
        built.scheduler.load_state_dict(ckpt.trainer["scheduler"])
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
        cfg.perf.gather_for_training,
        ptx=ptx,
    )


def report_iteration(logger, cfg, it: int, result: IterationResult, alerts: AlertMonitor) -> None:
    """Distributions, samples, alerts and the metrics row of one iteration (main process)."""
    stats = dict(result.stats)
    if result.distributions is not None:
        stats |= logger.log_distributions(it, result.distributions)
    if due(cfg.run.samples_every, it):
        logger.log_samples(it, result.samples)
    new_alerts = alerts.check(stats)
    logger.log_alerts(it, new_alerts)
    stats |= {f"alerts/{name}": 1.0 for name, _ in new_alerts}
    if it % cfg.run.log_every == 0 or it == cfg.ppo.iterations or new_alerts:
        logger.log(it, stats, CONSOLE_KEYS)


def trainer_state(run: PPORun, first_score: float, alerts: AlertMonitor) -> dict:
    """Everything besides weights and optimizer that a resumed run must continue from."""
    return {
        "kl_controller": run.kl_ctl.state_dict(),
        "score_moments": run.score_moments.state_dict(),
        "scheduler": run.scheduler.state_dict(),
        "first_score": first_score,
        "alerts": alerts.state_dict(),
        "ptx_position": run.ptx.position if run.ptx is not None else 0,  # batches drawn
    }


def stop_on_reward_failure(cfg, runtime, run_files, run: PPORun, done, state, error):
    """The error to end the run with after the reward failed (RewardFunctionError `error`,
    retries spent) in the iteration after `done`; raised on every rank together.

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
    return RewardFunctionError(
        f"{error}; iteration {step} and all before it are checkpointed in "
        f"{out / 'checkpoints'}: fix the reward, then continue with --resume auto"
    )


def train_ppo(cfg, runtime) -> dict:
    """Run PPO as configured; returns the summary written to summary.json."""
    ckpt, p = find_resume(cfg, runtime), cfg.ppo
    run = start_ppo(cfg, runtime, ckpt)
    prompts = training_prompts(cfg, run.tokenizer)
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
    for it, prompt_batch in zip(range(start + 1, p.iterations + 1), stream):
        rng = rng_state()  # as the checkpoint of iteration it - 1 holds it
        more = extra_prompts(prompts, run.plan, runtime, cfg.run.seed, pad, it)
        try:
            result = ppo_iteration(runtime, run, prompt_batch, cfg, it, more)
        except RewardFunctionError as e:
            state = trainer_state(run, first_score, alerts)
            failure = stop_on_reward_failure(
                cfg, runtime, (out, logger), run, (it - 1, rng), state, e
            )
            raise failure from e.__cause__
        stats = result.stats
        first_score = stats["objective/score"] if first_score is None else first_score
        report_iteration(logger, cfg, it, result, alerts)
        steps, trained = (it, p.iterations), (run.model, run.optimizer)
        safe_point(
            cfg, runtime, out, steps, preemption, trained, trainer_state(run, first_score, alerts)
        )
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
    return summary


def training_prompts(cfg, tokenizer):
    """data.train's usable prompts (`data.prompt_set`); at least one rollout batch of them."""
    d, p = cfg.data, cfg.ppo
    prompts = prompt_set(
        load_rows(d.train, "data.train", d.split), tokenizer, d, f"data.train {d.train!r}"
    )
    if len(prompts.ids) < p.rollout_batch_size:
        raise ConfigError(
            f"ppo.rollout_batch_size: {p.rollout_batch_size} is more than the {len(prompts.ids)} usable prompts"
        )
    return prompts
