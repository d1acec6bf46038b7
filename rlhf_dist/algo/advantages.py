"""Generalised advantage estimation (Schulman et al. 2016, eq. 16) over response tokens."""

from __future__ import annotations

import torch


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages and returns.

    rewards, values: (B, T) per-token shaped rewards and critic values; response_mask (B, T).
    delta_t = r_t + gamma * V_{t+1} * m_{t+1} - V_t
    A_t     = delta_t + gamma * lam * m_{t+1} * A_{t+1}
    Nothing bootstraps past the last response token: V and A there count as 0, since the
    episode ends at EOS (or at the length limit). returns = A + V is the critic's target.
    Returns (advantages, returns), both (B, T) and exactly 0 where the mask is False.
    """
    mask = response_mask.bool()
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    # Zero padded entries first so that garbage (even NaN) there cannot leak in via 0 * x.
    r = torch.where(mask, rewards.to(values.dtype), zero)
    v = torch.where(mask, values, zero)
    m = mask.to(values.dtype)
    B, T = v.shape
    adv = torch.zeros_like(v)
    next_value = torch.zeros(B, dtype=v.dtype, device=v.device)
    next_adv = torch.zeros(B, dtype=v.dtype, device=v.device)
    next_mask = torch.zeros(B, dtype=v.dtype, device=v.device)
    # A loop over time (T is the response length, tens to hundreds); vectorised over B.
    for t in reversed(range(T)):
        delta = r[:, t] + gamma * next_value * next_mask - v[:, t]
        adv[:, t] = (delta + gamma * lam * next_mask * next_adv) * m[:, t]
        next_value, next_adv, next_mask = v[:, t], adv[:, t], m[:, t]
    returns = torch.where(mask, adv + v, zero)
    return adv, returns
