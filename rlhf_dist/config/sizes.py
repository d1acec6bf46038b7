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


# DeepSpeed's own bucket default, used as a floor (elements): below it every bucket holds
# one small tensor and each collective pays its fixed latency for a few KiB.
MIN_BUCKET = 50_000_000


def zero_reduce_bucket(hidden: int, trainable: int) -> int:
    """ZeRO's gradient bucket (reduce_bucket_size, elements) when "auto"
    (distributed/deepspeed_config.py fill_zero_buckets): Accelerate's hidden^2, at least
    DeepSpeed's default or the whole trained model if smaller. Floors no larger than the
    model: a 5e7-element bucket for a 4.7M-parameter model made each ZeRO-3 rank hold 3.3x
    the model states of stage 0. The bucket may hold the whole model's gradients (one
    reduce per optimizer step: a ZeRO-3 iteration of the deep CPU benchmark took 3.95 s
    instead of 5.11 s with eighths, 3 alternated rounds, docs/benchmarks.md). ZeRO-3
    allocates it once, in the weights' dtype: the memory planner counts it."""
    return max(hidden * hidden, min(MIN_BUCKET, trainable))


def zero_prefetch_bucket(hidden: int, trainable: int) -> int:
    """ZeRO-3's stage3_prefetch_bucket_size when "auto": an eighth of the floor above, so
    fetching layer by layer does not turn into fetching everything."""
    return max(int(0.9 * hidden * hidden), min(MIN_BUCKET, trainable // 8))


def ppo_optimizer_steps(p) -> int:
    """Optimizer steps per PPO iteration (data/batching.py PPOPlan): ppo_epochs passes
    over the rollout, one step per minibatch."""
    minibatch = ppo_minibatch_size(p.minibatch_size, p.rollout_batch_size, p.samples_per_prompt)
    return ppo_epochs(p.ppo_epochs, p.estimator) * (
        p.rollout_batch_size * p.samples_per_prompt // minibatch
    )


def old_logprobs_from_update(cfg) -> bool:
    """Whether the rollout's scoring skips its actor pass (docs/architecture.md section 10,
    "no redundant forwards"): with ONE optimizer step per rollout (ppo_epochs = 1, one
    minibatch) pi_old is the policy of the update's forward, so its log-probs, detached,
    are the old log-probs (ratio exactly 1, as TRL does). Nothing before the update may
    need them: the KL must be a loss term (with kl_placement=reward the rewards read
    them). The critic, reference and scorer passes still run in scoring; the statistics
    that read old log-probs and entropies (objective/kl, objective/entropy, the vLLM
    sampler gap) are taken after the update. Not with ppo.dynamic_sampling (its refill
    joins rollouts) or ppo.overlong=mask (the update never sees a truncated row's tokens,
    so it could not give their old log-probs), nor with ppo.cov_control (it chooses its
    tokens from the old log-probs before the update, trainers/ppo_entropy.py). Read by the
    trainer and by the memory planner (a scoring phase without the actor's forward)."""
    p = cfg.ppo
    return (
        cfg.perf.old_logprobs_from_update
        and ppo_optimizer_steps(p) == 1
        and p.kl_placement == "loss"
        and not p.dynamic_sampling
        and p.overlong != "mask"
        and p.cov_control == "none"
    )
