"""The PPO recipe and its steps (docs/architecture.md section 5): `recipe.py` (train and
one iteration, in numbered steps), `prompts.py` (1), `rollout.py` (2-3), `advantages.py`
(4-6), `update.py` (7), `stats.py` (8), `state.py` (what carries over and is
checkpointed), `setup.py` (the models and `PPORun`), `entropy.py`, `ptx.py`,
`dynamic_sampling.py`, `evaluation.py`, and online DPO's objective, `online_dpo.py`."""

from __future__ import annotations

from rlhf_dist.trainers.ppo.recipe import train_ppo

__all__ = ["train_ppo"]
