"""Steps 4 to 6 of a PPO iteration (docs/architecture.md section 5): per-token rewards
from the scores (and the KL penalty), the advantages of the registered estimator
(algo/estimators.py) or none (on-policy distillation alone), and the rollout as the update sees it (DAPO's overlong mask,
whitening over all ranks). Each takes the frozen batch and returns new tensors.

Shapes: B rows (prompts x n), T response tokens.
"""

from __future__ import annotations

import dataclasses

import torch

from rlhf_dist.algo import catalog
from rlhf_dist.algo.estimators import (
    AdvantageInputs,
    estimate_advantages,
    estimate_on_masked_tokens,
)
from rlhf_dist.algo.masking import whiten_with
from rlhf_dist.algo.objectives import drop_truncated
from rlhf_dist.algo.rewards import score_rewards, shape_rewards, token_kl
from rlhf_dist.config import Config, PPOConfig
from rlhf_dist.distributed import Runtime
from rlhf_dist.rollout.batch import RolloutBatch
from rlhf_dist.stats import global_mean_var
from rlhf_dist.trainers.ppo.stats import overlong_stats
from rlhf_dist.trainers.ppo.update import UpdateResult

Advantages = tuple[torch.Tensor, torch.Tensor | None]  # (advantages (B, T), returns or None)


def rollout_rewards(
    batch: RolloutBatch, kl_coef: float, p: PPOConfig
) -> tuple[torch.Tensor, torch.Tensor | None]:
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


def estimate(
    name: str, batch: RolloutBatch, rewards: torch.Tensor, group_size: int, p: PPOConfig
) -> Advantages:
    """(advantages, returns or None) of estimator `name` on this rank's rollout. Multi-turn
    episodes: the recursions run over the sampled tokens only, across the tool tokens' gaps
    in the mask (docs/agents.md); single turns as always."""
    inputs = advantage_inputs(rewards, batch, group_size, p)
    if batch.response_attention is None:
        return estimate_advantages(name, inputs)
    return estimate_on_masked_tokens(name, inputs)


def no_task_advantages(
    name: str, batch: RolloutBatch, rewards: torch.Tensor, group_size: int, p: PPOConfig
) -> Advantages:
    """Step 5 of on-policy distillation alone (ppo.estimator=distill, docs/distill.md): the
    task reward gives no advantage, 0 on every token (B, T), and no returns. The learning
    signal is the teacher's per-token log-ratio (or GJSD) that the update adds
    (update.with_teacher_advantages); the scores are still computed and logged."""
    return torch.zeros_like(rewards), None


def advantage_inputs(
    rewards: torch.Tensor, batch: RolloutBatch, group_size: int, ppo_cfg: PPOConfig
) -> AdvantageInputs:
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


def trained_view(
    runtime: Runtime, batch: RolloutBatch, advantages: torch.Tensor, cfg: Config
) -> tuple[RolloutBatch, torch.Tensor, dict[str, float]]:
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


def whitens(ppo_cfg: PPOConfig) -> bool:
    """ppo.whiten_advantages, or the estimator's own rule where it is null."""
    if ppo_cfg.whiten_advantages is None:
        return catalog.ESTIMATORS[ppo_cfg.estimator].whitens
    return ppo_cfg.whiten_advantages


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
