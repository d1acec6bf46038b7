"""The state one PPO iteration reads and hands the next (docs/architecture.md section 5):
the KL coefficient's controller (Ziegler et al. 2019, eq. 2), the entropy bonus's
(entropy.py) and the running moments of the scores (rollout.normalize_scores). An
iteration takes a `Controllers` and returns a new one; none is changed in place, so a
failed iteration leaves the state the checkpoint of the one before it holds."""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any

from rlhf_dist.algo.entropy import EntropyController
from rlhf_dist.algo.kl import AdaptiveKLController, FixedKLController
from rlhf_dist.algo.masking import RunningMoments
from rlhf_dist.checkpoint import Checkpoint
from rlhf_dist.config import PPOConfig
from rlhf_dist.trainers.ppo.entropy import make_entropy_controller

KLController = FixedKLController | AdaptiveKLController


@dataclass(frozen=True)
class Controllers:
    """kl: the KL coefficient's controller; entropy: the entropy coefficient's;
    score_moments: the running mean and variance the scores are normalised by."""

    kl: KLController
    entropy: EntropyController
    score_moments: RunningMoments

    @classmethod
    def restored(cls, p: PPOConfig, ckpt: Checkpoint | None) -> Controllers:
        """As configured (ppo.kl_controller, ppo.entropy_target), or as the checkpoint
        kept them when resuming."""
        kl, moments, entropy = make_kl_controller(p), RunningMoments(), make_entropy_controller(p)
        if ckpt:
            kl.load_state_dict(ckpt.trainer["kl_controller"])
            if "entropy_controller" in ckpt.trainer:  # absent from checkpoints before it
                entropy.load_state_dict(ckpt.trainer["entropy_controller"])
            moments.load_state_dict(ckpt.trainer["score_moments"])
        return cls(kl, entropy, moments)

    def with_scores(self, mean: float, var: float, count: float) -> Controllers:
        """The controllers after a batch of `count` scores with this mean and population
        variance joined the running moments (Chan et al. 1979)."""
        moments = copy.copy(self.score_moments)  # plain floats: a copy is a new state
        moments.update(mean, var, count)
        return replace(self, score_moments=moments)

    def after(self, kl: float, entropy: float, sequences: int) -> Controllers:
        """The controllers for the next iteration, after one that measured `kl` (nats per
        response, objective/kl, over `sequences` responses) and `entropy` (nats per token,
        objective/entropy)."""
        entropy_ctl = copy.copy(self.entropy)  # plain floats: a copy is a new state
        entropy_ctl.update(entropy)
        return Controllers(self.kl.updated(kl, sequences), entropy_ctl, self.score_moments)

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's trainer-state entries (state.trainer_state)."""
        return {
            "kl_controller": self.kl.state_dict(),
            "entropy_controller": self.entropy.state_dict(),
            "score_moments": self.score_moments.state_dict(),
        }


def make_kl_controller(ppo_cfg: PPOConfig) -> KLController:
    """ppo.kl_controller: the adaptive controller (Ziegler et al. 2019) or a fixed coefficient."""
    if ppo_cfg.kl_controller == "adaptive":
        return AdaptiveKLController(ppo_cfg.kl_coef, ppo_cfg.kl_target, ppo_cfg.kl_horizon)
    return FixedKLController(ppo_cfg.kl_coef)
