"""PPO policy and value losses and the Bradley-Terry reward-model loss.

The masked means here are the per-call reference definitions. Trainers that split a
minibatch into micro-batches use the `*_terms` functions, which return per-token losses,
and divide token sums by the token count of the WHOLE minibatch (across ranks) so that
one optimizer step's gradient does not depend on how the batch was split.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlhf_dist.algo.masking import masked_mean


def ppo_policy_terms(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps: float,
) -> dict[str, torch.Tensor]:
    """Per-token clipped surrogate (Schulman et al. 2017, eq. 7), negated for minimisation.

    logprobs, old_logprobs, advantages: (B, T). Returns per-token (B, T) tensors:
    `loss` = max(-A*ratio, -A*clip(ratio, 1-eps, 1+eps)), `clipped` (1.0 where the clipped
    branch is strictly larger, i.e. where the gradient is cut), `approx_kl`
    = 0.5*(logprobs-old)^2 (k2 estimate of KL(old || new)), and `ratio`.
    """
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    return {
        "loss": torch.maximum(unclipped, clipped),
        "clipped": (clipped > unclipped).to(logprobs.dtype),
        "approx_kl": 0.5 * log_ratio.detach() ** 2,
        "ratio": ratio.detach(),
    }


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_eps: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Masked mean of the clipped surrogate loss over response tokens.

    All inputs (B, T). Returns (loss, stats) with 0-dim `clipfrac`, `approx_kl`, `ratio_mean`.
    """
    terms = ppo_policy_terms(logprobs, old_logprobs, advantages, clip_eps)
    stats = {
        "clipfrac": masked_mean(terms["clipped"], response_mask),
        "approx_kl": masked_mean(terms["approx_kl"], response_mask),
        "ratio_mean": masked_mean(terms["ratio"], response_mask),
    }
    return masked_mean(terms["loss"], response_mask), stats


def value_terms(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    clip_eps: float | None = None,
) -> dict[str, torch.Tensor]:
    """Per-token squared value error, optionally clipped around the rollout values.

    values, old_values, returns: (B, T). Returns (B, T) `loss` = 0.5*max((V-R)^2, (Vc-R)^2)
    with Vc = old + clamp(V-old, -eps, eps) (or 0.5*(V-R)^2 unclipped) and `clipped`.
    """
    sq_err = (values - returns) ** 2
    if clip_eps is None:
        return {"loss": 0.5 * sq_err, "clipped": torch.zeros_like(sq_err)}
    values_clipped = old_values + torch.clamp(values - old_values, -clip_eps, clip_eps)
    sq_err_clipped = (values_clipped - returns) ** 2
    return {
        "loss": 0.5 * torch.maximum(sq_err, sq_err_clipped),
        "clipped": (sq_err_clipped > sq_err).to(values.dtype),
    }


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    clip_eps: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """0.5 * masked mean of the (optionally clipped) squared value error.

    All inputs (B, T). Returns (loss, stats) with 0-dim `clipfrac`.
    """
    terms = value_terms(values, old_values, returns, clip_eps)
    stats = {"clipfrac": masked_mean(terms["clipped"], response_mask)}
    return masked_mean(terms["loss"], response_mask), stats


def pairwise_reward_terms(
    chosen_scores: torch.Tensor,
    rejected_scores: torch.Tensor,
    margin: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Per-pair Bradley-Terry loss -log sigmoid(s_chosen - s_rejected - margin), (B,).

    chosen_scores, rejected_scores: (B,); margin: None, a float or (B,). logsigmoid, not
    log(sigmoid(x)): finite for any score gap (sigmoid underflows to 0 near x = -100).
    """
    diff = chosen_scores - rejected_scores
    if margin is not None:
        diff = diff - margin
    return -F.logsigmoid(diff)


def pairwise_reward_loss(
    chosen_scores: torch.Tensor,
    rejected_scores: torch.Tensor,
    margin: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bradley-Terry loss -log sigmoid(s_chosen - s_rejected - margin) (Ouyang et al. 2022, eq. 1).

    chosen_scores, rejected_scores: (B,); margin: None, a float or (B,).
    Returns (loss, accuracy), both 0-dim: the mean of `pairwise_reward_terms` and the
    share of pairs with s_chosen > s_rejected (ties count as wrong).
    """
    loss = pairwise_reward_terms(chosen_scores, rejected_scores, margin).mean()
    accuracy = (chosen_scores > rejected_scores).to(chosen_scores.dtype).mean()
    return loss, accuracy
