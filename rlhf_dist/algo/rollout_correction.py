"""Corrections for rollouts sampled by another engine or an older policy
(ppo.rollout_correction; docs/algorithms.md, "Rollout correction").

A rollout server (or vLLM) samples with its own probabilities pi_rollout: other kernels
and precision, and with ppo.max_staleness >= 1 weights one update older than the
trainer's. PPO's objective is an expectation under the trainer's pi_old, so each
trained token (or sequence) is weighted by the importance ratio r = pi_old / pi_rollout,
bounded so that a token the sampler found unlikely cannot dominate a step. Three
published ways to bound it:

- tis: truncated IS, w = min(r, high) (Yao et al. 2025, "Your efficient RL framework
  secretly brings you off-policy RL training");
- mis: masked IS, w = r * 1[r <= high]: what truncation would cap is dropped instead
  (Liu et al. 2025, "When speed kills stability: demystifying RL collapse from the
  training-inference mismatch");
- icepop: w = r * 1[low <= r <= high] per token, both tails dropped (Ling Team 2025,
  "Every step evolves", IcePop).

The weights never carry gradients: they reweight the loss, they are not part of it.
"""

from __future__ import annotations

import torch

CORRECTION_METHODS = ("none", "tis", "mis", "icepop")
CORRECTION_LEVELS = ("token", "sequence")


def rollout_log_ratio(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    level: str,
) -> torch.Tensor:
    """log r = log pi_old - log pi_rollout, (B, T), detached; 0 outside response_mask.

    token: each token's own log-ratio. sequence: the row's log-ratio of the whole
    response, sum_t log r_t (the exact sequence importance ratio, a product of the
    token ratios, not GSPO's length-normalised one), on every response token of the row.
    old_logprobs, rollout_logprobs: (B, T); response_mask: (B, T) bool.
    """
    mask = response_mask.bool()
    diff = (old_logprobs - rollout_logprobs).detach()
    diff = torch.where(mask, diff, torch.zeros_like(diff))
    if level == "token":
        return diff
    if level == "sequence":
        per_row = diff.sum(dim=1, keepdim=True)
        return torch.where(mask, per_row.expand_as(diff), torch.zeros_like(diff))
    raise ValueError(f"rollout correction level must be one of {CORRECTION_LEVELS}, got {level!r}")


def truncated_weights(log_ratio: torch.Tensor, high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """TIS: (w = min(exp(log_ratio), high), corrected = where the cap cut r), both (B, T).
    exp overflows to inf for a huge log-ratio; the cap turns it into `high`."""
    ratio = torch.exp(log_ratio.detach())
    capped = ratio > high
    return ratio.clamp(max=high), capped


def masked_weights(
    log_ratio: torch.Tensor, low: float, high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked IS: (w = r * 1[low <= r <= high], corrected = where r fell outside), both
    (B, T); mis is low = 0 (only the upper tail dropped), icepop both tails. A dropped
    token keeps no loss at all, rather than a capped one."""
    ratio = torch.exp(log_ratio.detach())
    outside = (ratio < low) | (ratio > high)
    return torch.where(outside, torch.zeros_like(ratio), ratio), outside


def rollout_correction_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    method: str,
    level: str,
    low: float,
    high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, corrected), both (B, T): each trained token's loss weight under `method`
    (tis | mis | icepop; module docstring) at `level` (token | sequence; icepop is a token
    method), and where the weight differs from r (capped, or masked to 0). Outside
    response_mask the weight is 1 and nothing is corrected.
    old_logprobs, rollout_logprobs: (B, T); response_mask: (B, T) bool.
    """
    if method == "icepop" and level != "token":
        raise ValueError("icepop masks tokens: its level is token")
    log_ratio = rollout_log_ratio(old_logprobs, rollout_logprobs, response_mask, level)
    if method == "tis":
        weights, corrected = truncated_weights(log_ratio, high)
    elif method == "mis":
        weights, corrected = masked_weights(log_ratio, 0.0, high)
    elif method == "icepop":
        weights, corrected = masked_weights(log_ratio, low, high)
    else:
        raise ValueError(
            f"rollout correction must be one of {CORRECTION_METHODS[1:]}, got {method!r}"
        )
    mask = response_mask.bool()
    weights = torch.where(mask, weights, torch.ones_like(weights))
    return weights, corrected & mask


def behaviour_weights(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """The decoupled objective's unbounded weight w = pi_prox / pi_behav = exp(log pi_old -
    log pi_rollout) per token (B, T), detached; 1 outside response_mask (AReaL's weight
    with no cap; bound it with tis, mis or icepop above).
    old_logprobs, rollout_logprobs: (B, T); response_mask: (B, T) bool."""
    log_ratio = rollout_log_ratio(old_logprobs, rollout_logprobs, response_mask, "token")
    return torch.where(response_mask.bool(), torch.exp(log_ratio), torch.ones_like(log_ratio))
