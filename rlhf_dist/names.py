"""The registry names that config validation and the command line read, torch-free.

The names of algo's registries, and the traits each entry declares, are written once in
`rlhf_dist.algo.catalog` (torch-free; the registries are built from it and refuse a name
without a function at import): this module re-exports them, with the choices of the PPO
loop's own switches and the demo's algorithms, so that `rlhf-dist --help`, `rlhf-dist
config` and config errors return without importing torch (docs/architecture.md section 2).
"""

from __future__ import annotations

from rlhf_dist.algo.catalog import (
    DISTILL_LOSSES,
    DPO_LOSS_TYPES,
    ESTIMATORS,
    KL_KINDS,
    LOSS_AGGREGATIONS,
    ONLINE_DPO_LOSSES,
    POLICY_LOSSES,
    REFERENCE_FREE_LOSSES,
    EstimatorTraits,
)

__all__ = [
    "COV_CONTROLS",
    "DEMO_ALGORITHMS",
    "DEMO_ITERATIVE",
    "DEMO_OBJECTIVES",
    "DEMO_OFFLINE",
    "DEMO_RL_ALGORITHMS",
    "DPO_LOSS_TYPES",
    "DISTILL_LOSSES",
    "ESTIMATORS",
    "KL_KINDS",
    "LOSS_AGGREGATIONS",
    "ONLINE_DPO_LOSSES",
    "OVERLONG",
    "POLICY_LOSSES",
    "RATIO_LEVELS",
    "ROLLOUT_CORRECTIONS",
    "REFERENCE_FREE_LOSSES",
    "EstimatorTraits",
]

# The objectives of the one PPO loop (docs/agents.md, "Objectives")
RATIO_LEVELS = ("token", "sequence")  # ppo.ratio_level: PPO's per-token ratio or GSPO's
OVERLONG = ("none", "mask", "soft")  # ppo.overlong (DAPO)
COV_CONTROLS = ("none", "clip_cov", "kl_cov")  # ppo.cov_control (Cui et al. 2025)
# ppo.rollout_correction (algo/rollout_correction.py: the same names)
ROLLOUT_CORRECTIONS = ("none", "tis", "mis", "icepop")

# `rlhf-dist demo --algorithm`: rlhf_dist/demo/pipeline.py builds a stage list for each.
# The on-policy ones: PPO, the critic-free estimators, then the objective presets on
# GRPO's estimator (pipeline.OBJECTIVE_PRESETS, in this order).
DEMO_OBJECTIVES = ("gspo", "cispo", "dapo")
DEMO_RL_ALGORITHMS: tuple[str, ...] = (
    "ppo",
    "grpo",
    "rloo",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "online_dpo",
)
DEMO_RL_ALGORITHMS += DEMO_OBJECTIVES
# rlhf-dist dpo / kto on the preference pairs; simpo and orpo are rlhf-dist dpo with that
# dpo.loss_type (no reference model)
DEMO_OFFLINE = ("dpo", "kto", "simpo", "orpo")
DEMO_ITERATIVE = ("iterative",)  # SFT, then rounds of pairs -> RM -> PPO
DEMO_ALGORITHMS = DEMO_RL_ALGORITHMS + DEMO_OFFLINE + DEMO_ITERATIVE
