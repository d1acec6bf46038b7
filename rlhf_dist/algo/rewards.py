"""Per-token shaped rewards: KL penalty on every response token, score at the last one."""

from __future__ import annotations

import torch

from rlhf_dist.algo.kl import kl_estimate
from rlhf_dist.algo.masking import last_token_index


def token_kl(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, response_mask: torch.Tensor, kind: str
) -> torch.Tensor:
    """The per-token KL estimate `kind` (kl.kl_estimate) of the response tokens, 0 elsewhere;
    logprobs, ref_logprobs, response_mask: (B, T). Returns (B, T)."""
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    return torch.where(response_mask.bool(), kl_estimate(logprobs, ref_logprobs, kind), zero)


def score_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Each sequence's score at its last response token, 0 elsewhere (the rewards when the
    KL is a loss term, not a penalty in them). scores: (B,); response_mask (B, T). Returns
    (B, T) in the scores' dtype; a row with an empty mask gets nothing."""
    mask = response_mask.bool()
    rewards = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    rows = torch.arange(mask.shape[0], device=mask.device)
    zero = torch.zeros((), dtype=scores.dtype, device=scores.device)
    rewards[rows, last_token_index(mask)] = torch.where(mask.any(dim=-1), scores, zero)
    return rewards


def shape_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kl_kind: str = "k1",
) -> tuple[torch.Tensor, torch.Tensor]:
    """InstructGPT reward: r_t = -kl_coef * KL_t, plus the sequence score at the last token.

    scores: (B,) one score per sequence; logprobs, ref_logprobs: (B, T); response_mask (B, T).
    Returns (rewards, kl), both (B, T) and 0 outside the mask (`token_kl`,
    `score_rewards`). Rows with an empty mask get nothing at all.
    """
    kl = token_kl(logprobs, ref_logprobs, response_mask, kl_kind)
    return -kl_coef * kl + score_rewards(scores.to(kl.dtype), response_mask), kl
