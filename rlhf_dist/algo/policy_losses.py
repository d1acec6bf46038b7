"""Policy losses behind one registry, like the estimators (docs/algorithms.md).

Every policy loss takes one `PolicyLossInputs` and returns per-token (B, T) terms:
`loss` (to be aggregated by the trainer, losses.aggregation_weights), `clipped` (1.0 where
a clip cut the token's gradient or weight), `approx_kl` (k2 of logprobs - old_logprobs)
and `ratio`. The names are declared in catalog.POLICY_LOSSES (ppo.policy_loss's choices);
a new loss is one function here and one name there.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlhf_dist.algo import catalog
from rlhf_dist.algo.losses import ppo_policy_terms
from rlhf_dist.algo.objectives import cispo_terms


@dataclass(frozen=True)
class PolicyLossInputs:
    logprobs: torch.Tensor  # (B, T) under the policy being trained (with gradient)
    old_logprobs: torch.Tensor  # (B, T) under the policy that sampled (pi_old)
    advantages: torch.Tensor  # (B, T)
    # (B, T) the log-ratio to clip or weight by; None: logprobs - old_logprobs per token
    # (objectives.sequence_log_ratio gives GSPO's sequence ratio)
    log_ratio: torch.Tensor | None = None
    clip_eps_low: float | None = 0.2  # the ratio's lower bound 1 - low; None: no clip
    clip_eps_high: float | None = None  # upper bound 1 + high; None: = clip_eps_low
    dual_clip: float | None = None  # clip only: bound of a negative advantage's loss


def clip_loss(x: PolicyLossInputs) -> dict[str, torch.Tensor]:
    """PPO's clipped surrogate (Schulman et al. 2017, eq. 7) with clip-higher and dual
    clip: losses.ppo_policy_terms. No clip_eps_low: no clipping at all."""
    low = math.inf if x.clip_eps_low is None else x.clip_eps_low
    return ppo_policy_terms(
        x.logprobs, x.old_logprobs, x.advantages, low, x.clip_eps_high, x.dual_clip, x.log_ratio
    )


def cispo_loss(x: PolicyLossInputs) -> dict[str, torch.Tensor]:
    """CISPO (MiniMax-M1 2025): REINFORCE weighted by the clipped, stop-gradient ratio:
    objectives.cispo_terms. Bounds as for clip; dual clip does not apply."""
    low = math.inf if x.clip_eps_low is None else x.clip_eps_low
    high = low if x.clip_eps_high is None else x.clip_eps_high
    return cispo_terms(x.logprobs, x.old_logprobs, x.advantages, low, high, x.log_ratio)


PolicyLoss = Callable[[PolicyLossInputs], dict[str, torch.Tensor]]
POLICY_LOSSES = catalog.registry(catalog.POLICY_LOSSES, {"clip": clip_loss, "cispo": cispo_loss})


def policy_loss_terms(name: str, inputs: PolicyLossInputs) -> dict[str, torch.Tensor]:
    """The per-token terms (B, T) of the registered policy loss `name`."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"policy loss must be one of {tuple(POLICY_LOSSES)}, got {name!r}")
    return POLICY_LOSSES[name].fn(inputs)
