"""Policy losses behind one registry, like the estimators (docs/algorithms.md).

Every policy loss takes one `PolicyLossInputs` and returns per-token (B, T) terms:
`loss` (to be aggregated by the trainer, losses.aggregation_weights), `clipped` (1.0 where
a clip cut the token's gradient or weight), `approx_kl` (k2 of logprobs - old_logprobs)
and `ratio`. The names are declared in catalog.POLICY_LOSSES (ppo.policy_loss's choices);
a new loss is one function here, registered by its decorator, and one name there.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlhf_dist.algo import catalog


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


PolicyLoss = Callable[[PolicyLossInputs], dict[str, torch.Tensor]]
POLICY_LOSSES = catalog.Registry(catalog.POLICY_LOSSES)


@POLICY_LOSSES.register("clip")
def clip_loss(x: PolicyLossInputs) -> dict[str, torch.Tensor]:
    """Per-token clipped surrogate (Schulman et al. 2017, eq. 7), negated for minimisation:
    loss = max(-A r, -A clip(r, 1 - low, 1 + high)), r = exp(log_ratio).

    The upper bound 1 + clip_eps_high (None: clip_eps_low) above 1 + clip_eps_low is DAPO's
    "clip-higher" (Yu et al. 2025); no clip_eps_low: no clipping at all. dual_clip c > 1
    (Ye et al. 2020, eq. 5) also bounds the loss of a negative-advantage token by -c A, so
    one huge ratio cannot dominate the step. `approx_kl` is k2 of the per-token log-ratio,
    whatever ratio is clipped. All terms (B, T)."""
    low = math.inf if x.clip_eps_low is None else x.clip_eps_low
    high = low if x.clip_eps_high is None else x.clip_eps_high
    token_log_ratio = x.logprobs - x.old_logprobs  # (B, T)
    ratio = torch.exp(token_log_ratio if x.log_ratio is None else x.log_ratio)
    unclipped = -x.advantages * ratio
    clipped = -x.advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    loss = torch.maximum(unclipped, clipped)
    cut = clipped > unclipped  # the clip took the gradient away
    if x.dual_clip is not None:
        bound = -x.dual_clip * x.advantages
        dual = (x.advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        cut = cut | dual
    return {
        "loss": loss,
        "clipped": cut.to(x.logprobs.dtype),
        "approx_kl": 0.5 * token_log_ratio.detach() ** 2,
        "ratio": ratio.detach(),
    }


@POLICY_LOSSES.register("cispo")
def cispo_loss(x: PolicyLossInputs) -> dict[str, torch.Tensor]:
    """Per-token CISPO loss (MiniMax-M1 technical report, 2025, eq. 4), negated for
    minimisation: loss = -sg[clip(r, 1 - low, 1 + high)] A log pi.

    A REINFORCE loss whose importance weight r = pi/pi_old is clipped and carries no
    gradient: every token keeps a gradient (PPO's clip drops the tokens it clips), only its
    weight is bounded. low >= 1: no lower bound (MiniMax-M1 used the upper bound only);
    no clip_eps_low: no clip; dual clip does not apply. The loss VALUE is not PPO's (it is
    -w A log pi); its gradient at r = 1 is. All terms (B, T); `clipped` 1.0 where the
    weight was cut."""
    low = math.inf if x.clip_eps_low is None else x.clip_eps_low
    high = low if x.clip_eps_high is None else x.clip_eps_high
    token_log_ratio = x.logprobs - x.old_logprobs  # (B, T)
    r = torch.exp((token_log_ratio if x.log_ratio is None else x.log_ratio).detach())
    weight = r.clamp(min=max(1.0 - low, 0.0), max=1.0 + high)
    return {
        "loss": -weight * x.advantages * x.logprobs,
        "clipped": (weight != r).to(x.logprobs.dtype),
        "approx_kl": 0.5 * token_log_ratio.detach() ** 2,
        "ratio": r,
    }


POLICY_LOSSES.complete()


def policy_loss_terms(name: str, inputs: PolicyLossInputs) -> dict[str, torch.Tensor]:
    """The per-token terms (B, T) of the registered policy loss `name`."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"policy loss must be one of {tuple(POLICY_LOSSES)}, got {name!r}")
    return POLICY_LOSSES[name].fn(inputs)


def ppo_policy_terms(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps: float,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
    log_ratio: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """`clip_loss` with positional tensors (B, T): clip_eps the lower bound."""
    x = PolicyLossInputs(
        logprobs, old_logprobs, advantages, log_ratio, clip_eps, clip_eps_high, dual_clip
    )
    return clip_loss(x)


def cispo_terms(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps_low: float,
    clip_eps_high: float,
    log_ratio: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """`cispo_loss` with positional tensors (B, T)."""
    x = PolicyLossInputs(logprobs, old_logprobs, advantages, log_ratio, clip_eps_low, clip_eps_high)
    return cispo_loss(x)


def decoupled_policy_terms(
    name: str, x: PolicyLossInputs, behaviour_weights: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The decoupled PPO objective (Fu et al. 2025, "AReaL: a large-scale asynchronous RL
    system", eq. 5; Hilton et al. 2022, "Batch size-invariance for policy optimization"):
    J = E_behav[w * min(u A, clip(u, 1 - low, 1 + high) A)], u = pi / pi_prox,
    w = pi_prox / pi_behav, negated per token.

    x.old_logprobs is the proximal policy pi_prox (the trainer's weights before this update),
    which anchors the ratio u and its clip in the registered policy loss `name`; the
    behaviour policy (whoever sampled, maybe k updates older) enters only through the
    detached weight `behaviour_weights` (B, T): pi_prox / pi_behav per token, raw or bounded
    (rollout_correction.py). With pi_behav = pi_prox the weight is 1 and this is `name`.
    -> `name`'s terms (B, T) with `loss` weighted and `behaviour_weight` added."""
    terms = policy_loss_terms(name, x)
    w = behaviour_weights.detach().to(terms["loss"].dtype)
    return terms | {"loss": w * terms["loss"], "behaviour_weight": w}
