"""PPO policy and value losses and the Bradley-Terry reward-model loss (the per-token policy
losses themselves are the registered ones of algo/policy_losses.py).

The masked means here are the per-call reference definitions. Trainers that split a
minibatch into micro-batches use the `*_terms` functions, which return per-token losses,
and divide token sums by the token count of the WHOLE minibatch (across ranks) so that
one optimizer step's gradient does not depend on how the batch was split.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlhf_dist.algo import catalog
from rlhf_dist.algo.masking import masked_mean, masked_sum

# PPO's per-token clipped surrogate is the registered policy loss "clip"
from rlhf_dist.algo.policy_losses import ppo_policy_terms


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


# How per-token losses become one number (the names verl uses for the same choices):
# catalog.LOSS_AGGREGATIONS, each defined in aggregation_weights.
LOSS_AGGREGATIONS = catalog.LOSS_AGGREGATIONS


def aggregation_weights(
    response_mask: torch.Tensor, mode: str, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Per-token weights w (B, T) with loss = sum_bt w * l / D the `mode` aggregate, where
    D counts response tokens (token_mean) or sequences (seq_mean_*) of the WHOLE batch.

    token_mean: every token weighs the same (long answers weigh more);
    seq_mean_token_sum: each sequence's token SUM, averaged over sequences (Dr. GRPO's
    "no length normalisation", Liu et al. 2025, up to their constant);
    seq_mean_token_mean: each sequence's token MEAN, averaged (the original GRPO loss).
    Because D is a count over the whole batch and w depends on one row only, sums over any
    split of the rows add up to the same loss. 0 outside the mask; in `dtype` (the loss's:
    a 1/len weight computed in float32 would cost a float64 loss its precision). A row
    with no response token counts as a sequence (rollouts always sample one token).
    """
    m = response_mask.to(dtype)
    if mode in ("token_mean", "seq_mean_token_sum"):
        return m
    if mode == "seq_mean_token_mean":
        return m / m.sum(dim=1, keepdim=True).clamp(min=1.0)
    raise ValueError(f"loss aggregation must be one of {LOSS_AGGREGATIONS}, got {mode!r}")


def aggregation_count(response_mask: torch.Tensor, mode: str) -> torch.Tensor:
    """This batch's share of the denominator D of `aggregation_weights`: its number of
    response tokens (token_mean) or of sequences; response_mask (B, T) -> 0-dim float."""
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"loss aggregation must be one of {LOSS_AGGREGATIONS}, got {mode!r}")
    if mode == "token_mean":
        return response_mask.sum().float()
    return torch.tensor(float(response_mask.shape[0]), device=response_mask.device)


def aggregate_loss(per_token: torch.Tensor, response_mask: torch.Tensor, mode: str) -> torch.Tensor:
    """The `mode` aggregate of per-token losses (B, T) over one whole batch; 0-dim."""
    w = aggregation_weights(response_mask, mode, per_token.dtype)
    return masked_sum(w * per_token, response_mask) / aggregation_count(response_mask, mode)
