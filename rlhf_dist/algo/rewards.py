"""Per-token shaped rewards: KL penalty on every response token, score at the last one."""

from __future__ import annotations

import torch

from rlhf_dist.algo.kl import kl_estimate
from rlhf_dist.algo.masking import last_token_index


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
    Returns (rewards, kl), both (B, T) and 0 outside the mask. Rows with an empty mask get
    nothing at all.
    """
    mask = response_mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    kl = torch.where(mask, kl_estimate(logprobs, ref_logprobs, kl_kind), zero)
    rewards = -kl_coef * kl
    last = last_token_index(mask)
    has_tokens = mask.any(dim=-1)
    score_at_last = torch.zeros_like(rewards)
    score_at_last[torch.arange(rewards.shape[0], device=rewards.device), last] = torch.where(
        has_tokens, scores.to(rewards.dtype), zero
    )
    return rewards + score_at_last, kl
