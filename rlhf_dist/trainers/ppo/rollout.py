"""Steps 2 and 3 of a PPO iteration (docs/architecture.md section 5): the rollout, sampled
by the current policy and scored (rollout.collect_rollout), with DAPO's soft overlong
penalty and, with ppo.dynamic_sampling, tied groups refilled; then the scores' running
normalisation. Every step returns a new, frozen batch. Shared by every objective: PPO and
its estimators, online DPO and on-policy distillation."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlhf_dist.algo.objectives import overlong_penalty
from rlhf_dist.config import Config, RewardConfig
from rlhf_dist.distributed import Runtime
from rlhf_dist.rollout import PromptBatch, collect_rollout
from rlhf_dist.rollout.batch import RolloutBatch, describe_batch
from rlhf_dist.stats import global_moments
from rlhf_dist.trainers.common import checkpoint_due
from rlhf_dist.trainers.ppo.controllers import Controllers
from rlhf_dist.trainers.ppo.dynamic_sampling import rollout_until_full
from rlhf_dist.trainers.ppo.setup import PPORun


@dataclass(frozen=True)
class Rollout:
    """What step 2 gives: this rank's rollout batch (B rows), its response and prompt
    texts, dynamic sampling's statistics ({} without it), the seconds spent per phase
    ("generate", "score") and each row's prompt index (`PromptBatch.index`, () where
    unknown)."""

    batch: RolloutBatch
    texts: list[str]
    prompt_texts: list
    sampling_stats: dict[str, float]
    seconds: dict[str, float]
    prompt_index: tuple[int, ...] = ()


def sample_rollout(
    runtime: Runtime,
    run: PPORun,
    prompt_batch: PromptBatch,
    cfg: Config,
    more_prompts: Callable[[int], PromptBatch] | None = None,
    old_logprobs: bool = True,
) -> Rollout:
    """This rank's rollout, with the soft overlong penalty added to the scores
    (ppo.overlong=soft) and, with ppo.dynamic_sampling, tied groups replaced by groups of
    more prompts (more_prompts: round -> prompt batch; dynamic_sampling.py).
    old_logprobs=False: scoring skips the actor pass (old_logprobs_from_update)."""
    p, seconds = cfg.ppo, dict[str, float]()

    def rollout(prompts: PromptBatch) -> tuple[RolloutBatch, list[str]]:
        spent: dict[str, float] = {}
        with runtime.autocast():  # bf16 compute over fp32 weights, where that is the precision
            batch, texts = collect_rollout(
                run.rollout_models, prompts, cfg, run.tokenizer, spent, old_logprobs=old_logprobs
            )
        for name, spent_seconds in spent.items():
            seconds[name] = seconds.get(name, 0.0) + spent_seconds
        batch = without_unscored_rows(batch, run.plan.samples_per_prompt)
        if p.overlong == "soft":  # DAPO eq. 13 on |y|, the response's token count
            penalty = overlong_penalty(
                batch.response_mask.sum(1), cfg.generation.max_new_tokens, p.overlong_buffer
            )
            batch = dataclasses.replace(batch, scores=batch.scores + penalty.to(batch.scores.dtype))
        return batch, texts

    if not p.dynamic_sampling:
        batch, texts = rollout(prompt_batch)
        return Rollout(batch, texts, prompt_batch.texts, {}, seconds, prompt_batch.index)
    assert more_prompts is not None, "dynamic sampling draws more prompts"
    n, pad = run.plan.samples_per_prompt, run.tokenizer.pad_token_id
    rounds = p.dynamic_sampling_max_rounds
    batch, texts, prompts, stats, index = rollout_until_full(
        runtime, rollout, prompt_batch, more_prompts, n, rounds, pad
    )
    return Rollout(batch, texts, prompts, stats, seconds, index)


def without_unscored_rows(batch: RolloutBatch, group_size: int) -> RolloutBatch:
    """The rollout with each row no reward applied to (a NaN score: every reward function
    returned None, TRL's "does not apply") kept but out of the loss: its response_mask
    zeroed, as DAPO's overlong filter leaves a row, so no token of it is trained on, and
    its score (raw and penalised) the mean of its group's scored rows (0 where none is
    scored), so it moves neither its group's baseline nor, under a group estimator, has
    an advantage. Kept rather than dropped: every rank's batch keeps its shape, which the
    lock-step update and the groups (`group_size` consecutive rows) rely on. The Scorer
    counts these rows (reward/skipped_rows); a NaN never reaches the loss."""
    unscored = torch.isnan(batch.scores) | torch.isnan(batch.raw_scores)
    if not bool(unscored.any()):
        return batch
    n = group_size if unscored.numel() % group_size == 0 else 1
    mask = batch.response_mask.bool() & ~unscored[:, None].to(batch.response_mask.device)
    return dataclasses.replace(
        batch,
        scores=_group_fill(batch.scores, unscored, n),
        raw_scores=_group_fill(batch.raw_scores, unscored, n),
        response_mask=mask,
    )


def _group_fill(values: torch.Tensor, unscored: torch.Tensor, n: int) -> torch.Tensor:
    """values (B,) with each `unscored` row the mean of the scored rows of its group of
    `n` consecutive rows (0 where none of them is scored)."""
    skip = unscored.to(values.device).view(-1, n)
    known = torch.where(skip, torch.zeros_like(values.view(-1, n)), values.view(-1, n))
    fill = known.sum(1) / (~skip).sum(1).clamp(min=1).to(values.dtype)
    return torch.where(skip.reshape(-1), fill.repeat_interleave(n), values)


def normalize_scores(
    runtime: Runtime, scores: torch.Tensor, ctl: Controllers, reward_cfg: RewardConfig
) -> tuple[torch.Tensor, Controllers]:
    """(the scores (B,) normalised by the running moments with this batch's joined
    (statistics over all ranks) and clipped, the controllers with those moments)."""
    if reward_cfg.normalize:  # RunningMoments folds in population variances
        count, mean, sq_dev = global_moments(runtime, scores)
        ctl = ctl.with_scores(float(mean), float(sq_dev / count), float(count))
        moments = ctl.score_moments
        scores = (scores - moments.mean) / (moments.var + 1e-8) ** 0.5
    if reward_cfg.clip is not None:
        scores = scores.clamp(-reward_cfg.clip, reward_cfg.clip)
    return scores, ctl


def normalized(
    runtime: Runtime, ctl: Controllers, batch: RolloutBatch, cfg: Config
) -> tuple[RolloutBatch, Controllers]:
    """Step 3: (the rollout with its scores normalised and clipped, the controllers with
    the running moments moved; normalize_scores)."""
    scores, ctl = normalize_scores(runtime, batch.scores, ctl, cfg.reward)
    return dataclasses.replace(batch, scores=scores), ctl


def print_first_batch(
    runtime: Runtime, run: PPORun, cfg: Config, rollout: Rollout, it: int
) -> None:
    """debug.print_first_batch: the first rollout's rows token by token, once (main): at
    the run's first iteration in this process (run.first_iteration)."""
    if cfg.debug.print_first_batch and it == run.first_iteration and runtime.is_main:
        print(describe_batch(run.tokenizer, rollout.batch, rollout.texts), flush=True)


def expect_next(cfg: Config, run: PPORun, it: int, ahead: list[PromptBatch]) -> None:
    """ppo.max_staleness = k (generation/prefetch.py): tell the servers' client which of the
    next iterations' prompts `ahead` to request while iteration `it` trains: those up to
    `requested_through(it)` that `it - 1` did not request already. None past an iteration
    that writes a scheduled checkpoint, so the iteration after a checkpoint samples
    on-policy and a resumed run samples what the unbroken run did."""
    sampler = run.rollout_models.sampler
    sampler.expect_next(it, None)
    first = max(it, requested_through(cfg, it - 1)) + 1
    for later in range(first, requested_through(cfg, it) + 1):
        sampler.expect_next(it, ahead[later - it - 1])


def requested_through(cfg: Config, it: int) -> int:
    """The last iteration whose rollout is requested by the end of iteration `it`'s
    rollout: it + k, cut at the first iteration from `it` on that writes a scheduled
    checkpoint and at the last iteration (`it` itself: nothing ahead; 0 before the first)."""
    last, k = cfg.ppo.iterations, cfg.ppo.max_staleness
    if it <= 0:
        return 0
    for later in range(it, min(it + k, last) + 1):
        if checkpoint_due(cfg, later, last, False):
            return later
    return min(it + k, last)
