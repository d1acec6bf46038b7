"""Advantage estimators behind one registry (docs/architecture.md section 5).

Every estimator turns one rank's rollout into per-token advantages (B, T) and, where a
critic is trained, its regression targets. What each needs is declared next to it:
`needs_critic` (values V_t from a critic), `needs_groups` (several samples of one prompt,
rows [g*n, (g+1)*n) of the batch being the n samples of prompt g), and `whitens`, the
default of ppo.whiten_advantages (normalisation over the GLOBAL batch, done by the trainer
because its statistics need every rank).

Shapes: B sequences = prompts x n, T response tokens; `rewards` are the shaped per-token
rewards (sequence score at the last response token, minus the KL penalty on every token
when KL is a reward penalty); `scores` (B,) are the sequence scores alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlhf_dist.algo import catalog
from rlhf_dist.algo.advantages import gae
from rlhf_dist.algo.masking import last_token_index, pack_masked, unpack_masked


@dataclass(frozen=True)
class AdvantageInputs:
    rewards: torch.Tensor  # (B, T) shaped per-token rewards, 0 outside the mask
    scores: torch.Tensor  # (B,) sequence scores
    response_mask: torch.Tensor  # (B, T) bool, True = real response token
    values: torch.Tensor | None = None  # (B, T) critic values, for estimators that need them
    group_size: int = 1  # n samples per prompt, contiguous rows
    gamma: float = 1.0
    lam: float = 0.95
    std_normalize: bool = True  # grpo: divide by the group's std (False: Dr. GRPO)


def _zero_outside(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x (B, T) with 0 where mask (B, T) is False: padding adds nothing to a sum."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def sequence_returns(rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Undiscounted return of each sequence, sum_t r_t over its response tokens; (B,)."""
    return _zero_outside(rewards, response_mask).sum(dim=1)


def group_view(x: torch.Tensor, group_size: int, min_size: int = 1) -> torch.Tensor:
    """(B,) -> (B/n, n): row g holds the n samples of prompt g. min_size: the smallest n
    the caller's statistic is defined for (a baseline from the OTHER samples needs 2)."""
    if group_size < min_size:
        raise ValueError(f"groups of {group_size}: this estimator needs at least {min_size}")
    if group_size < 1 or x.shape[0] % group_size:
        raise ValueError(f"{x.shape[0]} rows do not split into groups of {group_size}")
    return x.reshape(-1, group_size)


def _broadcast(per_seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A per-sequence advantage (B,) on every response token: (B, T), 0 off the mask."""
    return _zero_outside(per_seq[:, None].expand(mask.shape).to(per_seq.dtype), mask)


# One signature: f(AdvantageInputs) -> (advantages, returns or None). The names and each
# one's traits (needs_critic, needs_groups, whitens) are declared in
# catalog.ADVANTAGE_ESTIMATORS (on-policy distillation alone and online DPO are objectives
# of their own, catalog.OBJECTIVES, not estimators);
# each function joins the registry where it is defined, by its decorator.
Advantages = tuple[torch.Tensor, torch.Tensor | None]  # (advantages (B, T), returns or None)
Estimator = Callable[[AdvantageInputs], Advantages]
ESTIMATORS = catalog.Registry(catalog.ADVANTAGE_ESTIMATORS)


@ESTIMATORS.register("gae")
def gae_estimator(x: AdvantageInputs) -> Advantages:
    """GAE (Schulman et al. 2016) with a critic: returns = A + V are the value targets."""
    return gae(x.rewards, x.values, x.response_mask, x.gamma, x.lam)


@ESTIMATORS.register("grpo")
def grpo_estimator(x: AdvantageInputs, eps: float = 1e-6) -> Advantages:
    """GRPO outcome advantage (Shao et al. 2024, DeepSeekMath section 4.1.2):
    A_i = (R_i - mean_group R) / (std_group R + eps) on every token of sample i, with
    R_i the sequence's total shaped reward and std the unbiased (n-1) group std.
    std_normalize=False is Dr. GRPO's (Liu et al. 2025) A_i = R_i - mean_group R.
    """
    R = group_view(sequence_returns(x.rewards, x.response_mask), x.group_size, min_size=2)
    A = R - R.mean(dim=1, keepdim=True)
    if x.std_normalize:
        A = A / (R.std(dim=1, keepdim=True) + eps)
    return _broadcast(A.reshape(-1), x.response_mask), None


@ESTIMATORS.register("rloo")
def rloo_estimator(x: AdvantageInputs) -> Advantages:
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024): each sample's baseline is the mean
    return of the OTHER n-1 samples of its prompt, A_i = R_i - (sum_j R_j - R_i)/(n-1)."""
    n = x.group_size
    R = group_view(sequence_returns(x.rewards, x.response_mask), n, min_size=2)
    A = R - (R.sum(dim=1, keepdim=True) - R) / (n - 1)
    return _broadcast(A.reshape(-1), x.response_mask), None


@ESTIMATORS.register("reinforce_pp")
def reinforce_pp_estimator(x: AdvantageInputs) -> Advantages:
    """REINFORCE++ (Hu 2025): the discounted return-to-go G_t = sum_{s>=t} gamma^(s-t) r_s
    of the shaped rewards (KL penalty on every token), no critic; the trainer whitens it
    over the global batch. G is GAE with V = 0 and lambda = 1."""
    zeros = torch.zeros_like(x.rewards)
    G, _ = gae(x.rewards, zeros, x.response_mask, x.gamma, 1.0)
    return G, None


@ESTIMATORS.register("reinforce_pp_baseline")
def reinforce_pp_baseline_estimator(x: AdvantageInputs) -> Advantages:
    """REINFORCE++-baseline: the group's mean score subtracted from each sample's score
    (at its last response token, where the score sits in `rewards`), then REINFORCE++."""
    baseline = group_view(x.scores, x.group_size).mean(dim=1, keepdim=True)
    baseline = baseline.expand(-1, x.group_size).reshape(-1).to(x.rewards.dtype)
    mask = x.response_mask.bool()
    at_last = torch.zeros_like(x.rewards)
    rows = torch.arange(x.rewards.shape[0], device=x.rewards.device)
    at_last[rows, last_token_index(mask)] = torch.where(mask.any(1), baseline, 0.0)
    shifted = AdvantageInputs(x.rewards - at_last, x.scores, mask, gamma=x.gamma)
    return reinforce_pp_estimator(shifted)


ESTIMATORS.complete()


def estimate_advantages(name: str, inputs: AdvantageInputs) -> Advantages:
    """(advantages (B, T), returns (B, T) or None) of the registered estimator `name`."""
    return ESTIMATORS[name].fn(inputs)


def estimate_on_masked_tokens(name: str, inputs: AdvantageInputs) -> Advantages:
    """`estimate_advantages` with each row's masked tokens packed to a prefix first
    (masking.pack_masked), and the results put back at their positions (0 elsewhere).

    For multi-turn episodes, whose response_mask has gaps where tool and environment
    tokens are (docs/agents.md): the recursions of gae and reinforce_pp then run over the
    policy's own tokens only, so the return of a turn carries the later turns' rewards
    and values across the tool's tokens (delta_t bootstraps from V at the next SAMPLED
    token) instead of stopping at the first gap. With a prefix mask it equals
    estimate_advantages on the masked tokens.
    """
    m = inputs.response_mask
    rewards, packed_mask = pack_masked(inputs.rewards, m)
    values = None if inputs.values is None else pack_masked(inputs.values, m)[0]
    packed = dataclasses.replace(inputs, rewards=rewards, values=values, response_mask=packed_mask)
    advantages, returns = estimate_advantages(name, packed)
    return unpack_masked(advantages, m), None if returns is None else unpack_masked(returns, m)
