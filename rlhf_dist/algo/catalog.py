"""The names in algo's registries and what each entry declares, torch-free: the one place
they are written. The registries (estimators.ESTIMATORS, policy_losses.POLICY_LOSSES) are
built from these with `registry`, which refuses at import a name without a function or a
function without a name; rlhf_dist.names re-exports them for config validation and the
command line, which import no torch (docs/architecture.md section 3)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple


class EstimatorTraits(NamedTuple):
    """What an advantage estimator needs (docs/architecture.md section 5)."""

    needs_critic: bool  # values V_t from a critic
    needs_groups: bool  # several samples of one prompt, contiguous rows
    whitens: bool  # the default of ppo.whiten_advantages


ESTIMATORS: dict[str, EstimatorTraits] = {
    "gae": EstimatorTraits(needs_critic=True, needs_groups=False, whitens=True),
    "grpo": EstimatorTraits(needs_critic=False, needs_groups=True, whitens=False),
    "rloo": EstimatorTraits(needs_critic=False, needs_groups=True, whitens=False),
    "reinforce_pp": EstimatorTraits(needs_critic=False, needs_groups=False, whitens=True),
    "reinforce_pp_baseline": EstimatorTraits(needs_critic=False, needs_groups=True, whitens=True),
    # on-policy distillation alone: no task advantage, the teacher's signal is the update's
    "distill": EstimatorTraits(needs_critic=False, needs_groups=False, whitens=False),
    # online DPO: the best and worst sample of each prompt form a pair for the DPO loss;
    # its "advantages" are the pair labels (+1 chosen, -1 rejected), the update reads pairs
    "online_dpo": EstimatorTraits(needs_critic=False, needs_groups=True, whitens=False),
}
# ppo.policy_loss: PPO's clipped surrogate, or CISPO's clipped stop-gradient weight
POLICY_LOSSES = ("clip", "cispo")
KL_KINDS = ("k1", "k2", "k3")  # kl.kl_estimate
# ppo.distill_loss (algo/distill.py): the sampled-token reverse KL as a per-token advantage,
# or GKD's generalised JSD over the whole vocabulary as a loss term
DISTILL_LOSSES = ("reverse_kl", "gjsd")
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean")  # losses
# dpo.loss_type (algo/preference.py). SimPO and ORPO score the policy alone: with them the
# DPO stage builds no reference model (trainers/dpo.py).
DPO_LOSS_TYPES = ("sigmoid", "ipo", "simpo", "orpo")
REFERENCE_FREE_LOSSES = ("simpo", "orpo")
# ppo.dpo_loss of ppo.estimator=online_dpo: the DPO losses that compare with the reference
ONLINE_DPO_LOSSES = ("sigmoid", "ipo")


class Entry(NamedTuple):
    """A registered function and the traits its name was declared with."""

    fn: Callable
    traits: Any


def registry(declared, functions: dict[str, Callable]) -> dict[str, Entry]:
    """name -> Entry(function, traits) for every name `declared` (a name -> traits dict,
    or a tuple of names: no traits), in its order. A declared name without a function, or
    a function under an undeclared name, is a ValueError at import."""
    names = tuple(declared)
    if set(functions) != set(names):
        missing, extra = set(names) - set(functions), set(functions) - set(names)
        raise ValueError(f"registry: no function for {sorted(missing)}; undeclared {sorted(extra)}")
    traits = declared if isinstance(declared, dict) else dict.fromkeys(names)
    return {name: Entry(functions[name], traits[name]) for name in names}
