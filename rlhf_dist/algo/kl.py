"""Per-token KL estimators and KL-coefficient controllers.

Estimators of KL(pi || ref) from tokens sampled from pi (Schulman, "Approximating KL
divergence", 2020), with d = logprobs - ref_logprobs = log pi/ref:
  k1 = d                      unbiased, high variance, can be negative per token
  k2 = d^2 / 2                biased, low variance
  k3 = exp(-d) - (-d) - 1     unbiased, always >= 0 (~ d^2/2 for small d)
"""

from __future__ import annotations

import torch

from rlhf_dist.algo.catalog import KL_KINDS


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate; logprobs, ref_logprobs: (B, T). Returns (B, T)."""
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        # expm1(x) - x instead of exp(x) - 1 - x: exact near 0, where k3 ~ x^2/2.
        neg = -log_ratio
        return torch.expm1(neg) - neg
    raise ValueError(f"kl kind must be one of {KL_KINDS}, got {kind!r}")


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, coef: float):
        self.coef = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt; present so both controllers are used the same way."""

    def updated(self, current_kl: float, n_steps: int) -> FixedKLController:
        """The controller after `update`, a new one (this one unchanged): the same."""
        return FixedKLController(self.coef)

    def state_dict(self) -> dict:
        return {"coef": self.coef}

    def load_state_dict(self, state: dict) -> None:
        self.coef = float(state["coef"])


class AdaptiveKLController:
    """Proportional controller steering the KL to `target` (Ziegler et al. 2019, eq. 2).

    error = clip(KL/target - 1, -0.2, 0.2); coef <- coef * (1 + error * n_steps / horizon).
    """

    def __init__(self, init_coef: float, target: float, horizon: float):
        if target <= 0 or horizon <= 0:
            raise ValueError("AdaptiveKLController needs target > 0 and horizon > 0")
        self.coef = float(init_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """One step from the KL measured over `n_steps` sequences (in place)."""
        self.coef = self.updated(current_kl, n_steps).coef

    def updated(self, current_kl: float, n_steps: int) -> AdaptiveKLController:
        """The controller after one step (eq. 2), a new one; this one is unchanged."""
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        coef = self.coef * (1.0 + error * n_steps / self.horizon)
        return AdaptiveKLController(coef, self.target, self.horizon)

    def state_dict(self) -> dict:
        return {"coef": self.coef}

    def load_state_dict(self, state: dict) -> None:
        self.coef = float(state["coef"])
