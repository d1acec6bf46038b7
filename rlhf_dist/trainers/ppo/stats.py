"""What one PPO iteration reports (docs/metrics.md): rollout, objective and value
statistics, overlong shares, histograms gathered from all ranks, costs, samples, and the
metrics row with its alerts. Every mean is a token or sequence SUM reduced over all ranks
and divided once (stats.StatSums), never a mean of per-rank means."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rlhf_dist.algo.kl import kl_estimate
from rlhf_dist.algo.masking import masked_sum
from rlhf_dist.algo.objectives import (
    overlong_penalty,
)
from rlhf_dist.algo.rewards import token_kl
from rlhf_dist.config import Config
from rlhf_dist.data.chat import prompt_text
from rlhf_dist.distributed import Runtime
from rlhf_dist.generation import Sampler
from rlhf_dist.models import routing
from rlhf_dist.observability.alerts import AlertMonitor
from rlhf_dist.observability.tracking import MetricsLogger
from rlhf_dist.rollout.agent import episode_stats
from rlhf_dist.rollout.batch import RolloutBatch
from rlhf_dist.stats import StatSums, global_moments
from rlhf_dist.trainers.common import (
    padding_cells,
)
from rlhf_dist.trainers.ppo.controllers import Controllers
from rlhf_dist.trainers.ppo.setup import PPORun

if TYPE_CHECKING:  # the rollout step's and the update's results, read here only
    from rlhf_dist.trainers.ppo.rollout import Rollout
    from rlhf_dist.trainers.ppo.update import UpdateResult


def rollout_stats(
    runtime: Runtime,
    batch: RolloutBatch,
    kl: torch.Tensor,
    advantages: torch.Tensor,
    returns: torch.Tensor | None,
    kl_coef: float,
) -> dict[str, float]:
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


def distill_stats(runtime: Runtime, batch: RolloutBatch) -> dict[str, float]:
    """On-policy distillation (docs/distill.md): the student's reverse KL to the teacher,
    KL(pi_old || pi_teacher), estimated on the sampled tokens (k1: log pi_old - log
    pi_teacher), as distill/reverse_kl (nats per response, a sequence mean like
    objective/kl) and distill/reverse_kl_per_token (a token mean); {} without a teacher."""
    if batch.teacher_logprobs is None:
        return {}
    mask = batch.response_mask
    kl = token_kl(batch.old_logprobs, batch.teacher_logprobs, mask, "k1")  # (B, T)
    s = StatSums()
    s.add("distill/reverse_kl", kl.sum(), mask.shape[0])
    s.add("distill/reverse_kl_per_token", kl.sum(), mask.sum())
    return s.reduce(runtime)


def _population_var(runtime: Runtime, x: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """Variance over all ranks, divided by n (stats.global_moments)."""
    count, _, sq_dev = global_moments(runtime, x, mask)
    return float(sq_dev / count.clamp(min=1))


def due(every: int, it: int) -> bool:
    """Whether a thing done every `every` iterations (0: never) is due at iteration it."""
    return every > 0 and it % every == 0


def overlong_stats(
    runtime: Runtime, batch: RolloutBatch, trained_mask: torch.Tensor, cfg: Config
) -> dict[str, float]:
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


def sample_rows(
    prompt_texts: list,
    texts: list[str],
    batch: RolloutBatch,
    kl: torch.Tensor,
    extra: list[dict] | None = None,
    prompt_index: tuple[int, ...] = (),
) -> list[dict]:
    """The samples table's rows: prompt (conversations as readable text), its index among
    data.train's usable prompts when known (`prompt_index`, which names the prompt a
    trained row came from), response, score, the response's summed KL (kl: (B, T)
    per-token), its length (the trained tokens of `response_mask`, (B, T): a run's length
    distribution, e.g. trained against sampled with ppo.max_staleness), then each row's
    `extra` columns (the ones its rewards logged with TRL's log_extra,
    Scorer.take_extra_columns)."""
    prompts = [prompt_text(p) for p in prompt_texts]
    lengths = batch.response_mask.sum(1).tolist()
    rows = zip(prompts, texts, batch.scores.tolist(), kl.sum(1).tolist(), lengths)
    out = [
        {"prompt": a, "response": b, "score": c, "kl": d, "length": n, **e}
        for (a, b, c, d, n), e in zip(rows, extra or [{}] * len(texts))
    ]
    if prompt_index:
        out = [{"prompt": r["prompt"], "prompt_index": i} | r for r, i in zip(out, prompt_index)]
    return out


def gather_distributions(
    runtime: Runtime, batch: RolloutBatch, advantages: torch.Tensor, kl: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Every rank's advantages, KL, scores and lengths, for histograms (a collective)."""
    mask = batch.response_mask
    named = {
        "advantages": advantages[mask],
        "kl": kl[mask],
        "scores": batch.scores,
        "length": mask.sum(1),
    }
    return {k: torch.tensor(runtime.gather_objects(v.float().tolist())) for k, v in named.items()}


def iteration_costs(
    runtime: Runtime,
    run: PPORun,
    ctl: Controllers,
    times: tuple[float, float, float],
    timings: dict[str, float],
    mask: torch.Tensor,
    cfg: Config,
) -> dict[str, float]:
    """Time, throughput and peak memory of an iteration (throughput over all ranks)."""
    t0, t1, t2 = times
    tokens = float(runtime.all_sum(mask.sum().double()))
    peak = float(runtime.all_max(torch.tensor(float(runtime.peak_memory_bytes()))))
    return {
        "optim/kl_coef": ctl.kl.coef,
        "entropy/coef": ctl.entropy.coef,  # this iteration's; the controller moves after
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


def memory_plan_stats(
    runtime: Runtime, planned: dict[str, float], measured: dict[str, int | None]
) -> dict[str, float]:
    """The memory plan's per-rank peak of each phase (rlhf-dist plan; constant over the
    run) and, on a GPU, the measured peak of the most loaded rank: the rollout
    (generation and scoring together: one measurement) and the update."""
    stats = {f"memory/planned_{phase}_gib": b / 2**30 for phase, b in planned.items()}
    for phase, nbytes in measured.items():
        if nbytes is not None:
            peak = float(runtime.all_max(torch.tensor(float(nbytes))))
            stats[f"memory/measured_{phase}_gib"] = peak / 2**30
    return stats


def server_stats(runtime: Runtime, sampler: Sampler) -> dict[str, float]:
    """generation.backend=server (docs/serving.md): the last post-sync check's mean
    per-token log-prob gap (the largest over the servers), the policy version the rollout
    was sampled with, the sync's seconds and its memory growth on the rank that grew most
    (sampled: GPU tensor memory, else the resident set; the gathered buckets and rank 0's
    host copies of one); {} with another backend. With ppo.max_staleness
    (generation/prefetch.py) also the rollout's staleness over the ranks, the rollouts dropped
    as too stale so far and the seconds the servers took for it (on a background thread,
    beside the previous iteration's update). A collective: the sampler's `stats`."""
    return sampler.stats(runtime)


CONSOLE_KEYS = (
    "objective/score",
    "objective/kl",
    "objective/entropy",
    "rollout/length",
    "policy/clipfrac",
    "value/explained_variance",
)


def report_iteration(
    logger: MetricsLogger, cfg: Config, it: int, result: IterationResult, alerts: AlertMonitor
) -> None:
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


@dataclass(frozen=True)
class IterationResult:
    """What an iteration returns: its metrics row, histograms, samples, and the
    controllers the next iteration runs with (controllers.py)."""

    stats: dict[str, float]
    distributions: dict[str, torch.Tensor] | None  # name -> values from all ranks (when due)
    samples: list[dict]  # this rank's first few (prompt, response, score, kl) rows
    controllers: Controllers


@dataclass(frozen=True)
class PPOStats:
    """What one PPO iteration's steps hand its statistics: the rollout (step 2, with its
    dynamic-sampling statistics and seconds), the batch after the update (old log-probs
    known), the per-token KL, advantages and returns (B, T; returns None without a
    critic), the update's view's statistics (overlong, cov_control) and the update's
    result. Turned into the metrics row by `iteration_result`."""

    rollout: Rollout
    batch: RolloutBatch
    kl: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor | None
    view_stats: dict[str, float]
    update: UpdateResult


def routing_stats(runtime: Runtime, run: PPORun, batch: RolloutBatch) -> dict[str, float]:
    """Router metrics and the sampler-vs-trainer gap with and without routing replay
    (models/routing.py; docs/moe.md); {} without a recorded routing."""
    mask, experts = batch.response_mask, routing.experts_of(run.model)
    out = routing.router_stats(
        runtime, mask, batch.response_routing, batch.router_entropy, batch.router_flips, experts
    )
    gaps = (batch.sampler_logprobs, batch.old_logprobs, batch.unreplayed_logprobs)
    return out | routing.logprob_gap_stats(runtime, mask, *gaps)


def iteration_result(
    runtime: Runtime,
    run: PPORun,
    ctl: Controllers,
    cfg: Config,
    it: int,
    phases: PPOStats,
    times: tuple[float, float, float],
    planned: dict[str, float] | None,
    measured: dict[str, int | None],
) -> IterationResult:
    """The metrics row (docs/metrics.md), histograms when due and samples of one PPO
    iteration, with the controllers `ctl` it ran with. Collectives, in the same order on
    every rank."""
    batch, kl, rollout = phases.batch, phases.kl, phases.rollout
    stats = rollout_stats(runtime, batch, kl, phases.advantages, phases.returns, ctl.kl.coef)
    stats |= rollout.sampling_stats | phases.view_stats
    stats |= run.scorer.component_stats(runtime) | phases.update.stats
    stats |= distill_stats(runtime, batch)  # {} without model.teacher
    stats |= server_stats(runtime, run.rollout_models.sampler)  # {} without rollout servers
    stats |= routing_stats(runtime, run, batch)  # {} without ppo.routing_replay
    distributions = None
    if due(cfg.run.histogram_every, it):  # a collective: every rank takes part
        distributions = gather_distributions(runtime, batch, phases.advantages, kl)
    stats |= iteration_costs(runtime, run, ctl, times, rollout.seconds, batch.response_mask, cfg)
    stats |= memory_plan_stats(runtime, planned or {}, measured)
    extra = run.scorer.take_extra_columns(rollout.prompt_texts, rollout.texts)  # log_extra's
    samples = sample_rows(
        rollout.prompt_texts, rollout.texts, batch, kl, extra, rollout.prompt_index
    )
    return IterationResult(stats, distributions, samples[: cfg.run.num_samples], ctl)
