"""The names in algo's registries and what each entry declares, torch-free: the one place
they are written. The registries (estimators.ESTIMATORS, policy_losses.POLICY_LOSSES) are
`Registry`s of these names, each function added where it is defined by the registry's
`register(name)` decorator; a function under an undeclared name, or (at `complete`, the
end of the defining module) a declared name without a function, is a ValueError at
import. rlhf_dist.names re-exports the names for config validation and the command line,
which import no torch (docs/architecture.md section 3)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

F = TypeVar("F", bound=Callable)


class EstimatorTraits(NamedTuple):
    """What an advantage estimator needs (docs/architecture.md section 5)."""

    needs_critic: bool  # values V_t from a critic
    needs_groups: bool  # several samples of one prompt, contiguous rows
    whitens: bool  # the default of ppo.whiten_advantages


# The advantage estimators of the PPO iteration (estimators.ESTIMATORS)
ADVANTAGE_ESTIMATORS: dict[str, EstimatorTraits] = {
    "gae": EstimatorTraits(needs_critic=True, needs_groups=False, whitens=True),
    "grpo": EstimatorTraits(needs_critic=False, needs_groups=True, whitens=False),
    "rloo": EstimatorTraits(needs_critic=False, needs_groups=True, whitens=False),
    "reinforce_pp": EstimatorTraits(needs_critic=False, needs_groups=False, whitens=True),
    "reinforce_pp_baseline": EstimatorTraits(needs_critic=False, needs_groups=True, whitens=True),
}
# Objectives of their own on the same rollout (trainers/ppo/), chosen by the same key,
# ppo.estimator: no advantage estimator of the registry.
OBJECTIVES: dict[str, EstimatorTraits] = {
    # on-policy distillation alone: no task advantage, the teacher's signal is the update's
    "distill": EstimatorTraits(needs_critic=False, needs_groups=False, whitens=False),
    # online DPO: the best and worst sample of each prompt form a pair for the DPO loss
    # (preference.best_worst_pairs; the pair labels, preference.pair_labels, are logged)
    "online_dpo": EstimatorTraits(needs_critic=False, needs_groups=True, whitens=False),
}
# ppo.estimator's choices and what each needs (config validation, the memory planner)
ESTIMATORS: dict[str, EstimatorTraits] = {**ADVANTAGE_ESTIMATORS, **OBJECTIVES}
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


class Registry(dict[str, Entry]):
    """name -> Entry(function, traits) for the names `declared` (a name -> traits dict, or
    a tuple of names: no traits), each function added where it is defined by the
    `register(name)` decorator. `complete()`, called once every function is registered,
    refuses a declared name without one and orders the entries as declared."""

    def __init__(self, declared: dict[str, Any] | tuple[str, ...]) -> None:
        super().__init__()
        names = tuple(declared)
        self._traits = declared if isinstance(declared, dict) else dict.fromkeys(names)

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator: the function is the entry of declared name `name` (returned as is)."""

        def add(fn: F) -> F:
            if name not in self._traits or name in self:
                raise ValueError(f"registry: {name!r} is undeclared or registered twice")
            self[name] = Entry(fn, self._traits[name])
            return fn

        return add

    def complete(self) -> Registry:
        """The registry itself, checked whole: every declared name has its function."""
        missing = [name for name in self._traits if name not in self]
        if missing:
            raise ValueError(f"registry: no function for {sorted(missing)}")
        entries = [(name, self.pop(name)) for name in self._traits]
        self.update(entries)
        return self
