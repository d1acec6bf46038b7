"""The registry names that config validation and the command line read, torch-free.

`rlhf_dist.algo` keeps its own registries (it imports torch only and nothing of the
package); these are their names and the traits validation needs, so that
`rlhf-dist --help`, `rlhf-dist config` and config errors return without importing torch
(docs/architecture.md section 2). tests/unit/test_unit_names.py asserts that each tuple
here equals the keys of the algo registry it mirrors.
"""

from __future__ import annotations

from typing import NamedTuple


class EstimatorTraits(NamedTuple):
    """What an advantage estimator needs (docs/architecture.md section 5)."""

    needs_critic: bool  # values V_t from a critic
    needs_groups: bool  # several samples of one prompt, contiguous rows
    whitens: bool  # the default of ppo.whiten_advantages


# algo.estimators.ESTIMATORS, in its order
ESTIMATORS: dict[str, EstimatorTraits] = {
    "gae": EstimatorTraits(needs_critic=True, needs_groups=False, whitens=True),
    "grpo": EstimatorTraits(needs_critic=False, needs_groups=True, whitens=False),
    "rloo": EstimatorTraits(needs_critic=False, needs_groups=True, whitens=False),
    "reinforce_pp": EstimatorTraits(needs_critic=False, needs_groups=False, whitens=True),
    "reinforce_pp_baseline": EstimatorTraits(needs_critic=False, needs_groups=True, whitens=True),
}
KL_KINDS = ("k1", "k2", "k3")  # algo.kl.KL_KINDS
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean")  # algo.losses
# The objectives of the one PPO loop (docs/agents.md, "Objectives")
RATIO_LEVELS = ("token", "sequence")  # ppo.ratio_level: PPO's per-token ratio or GSPO's
POLICY_LOSSES = ("clip", "cispo")  # ppo.policy_loss
OVERLONG = ("none", "mask", "soft")  # ppo.overlong (DAPO)

# `rlhf-dist demo --algorithm`: rlhf_dist/demo/pipeline.py builds a stage list for each.
# The on-policy ones: PPO, the critic-free estimators, then the objective presets on
# GRPO's estimator (pipeline.OBJECTIVE_PRESETS, in this order).
DEMO_OBJECTIVES = ("gspo", "cispo", "dapo")
DEMO_RL_ALGORITHMS = ("ppo", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
DEMO_RL_ALGORITHMS += DEMO_OBJECTIVES
DEMO_OFFLINE = ("dpo", "kto")  # rlhf-dist dpo / kto on the preference pairs
DEMO_ITERATIVE = ("iterative",)  # SFT, then rounds of pairs -> RM -> PPO
DEMO_ALGORITHMS = DEMO_RL_ALGORITHMS + DEMO_OFFLINE + DEMO_ITERATIVE
