"""Sizes the config leaves to the run (torch-free: validation uses them before anything
loads, data/batching.py builds the batch plans from them). A key set to its "auto" value
(0 or null) means the rule here; a number given is used as given."""

from __future__ import annotations

from rlhf_dist.names import ESTIMATORS

# Rows per forward/backward pass at most when micro_batch_size is auto (0): TRL's
# per_device_train_batch_size default, a size real models fit with checkpointing.
AUTO_MICRO_BATCH_ROWS = 8
# ppo.ppo_epochs null: N+'s 4 passes with a critic; one optimizer step per rollout for the
# critic-free estimators, as TRL's GRPO (num_iterations 1).
PPO_EPOCHS_WITH_CRITIC = 4


def micro_batch_size(requested: int, global_size: int, world_size: int) -> int:
    """Rows per rank per forward/backward pass: `requested`, or with 0 the largest divisor
    of the per-rank share (global_size / world_size) that is at most
    AUTO_MICRO_BATCH_ROWS, so every rank's share splits into equal micro-batches."""
    if requested:
        return requested
    share = max(1, global_size // world_size)
    return max(d for d in range(1, min(share, AUTO_MICRO_BATCH_ROWS) + 1) if share % d == 0)


def ppo_epochs(requested: int | None, estimator: str) -> int:
    """Passes over each rollout: `requested`, or with null 4 for an estimator with a
    critic (gae) and 1 for the critic-free ones."""
    if requested is not None:
        return requested
    return PPO_EPOCHS_WITH_CRITIC if ESTIMATORS[estimator].needs_critic else 1


def ppo_minibatch_size(requested: int, rollout_batch_size: int, samples_per_prompt: int) -> int:
    """Sequences per optimizer step: `requested`, or with 0 the whole rollout (prompts x
    samples per prompt): one optimizer step per pass over it."""
    return requested or rollout_batch_size * samples_per_prompt
