"""Sizes the config leaves to the run, and which models a run loads and runs (torch-free:
validation uses them before anything loads, data/batching.py builds the batch plans from
them, the memory planner counts what they say is resident). A key set to its "auto" value
(0 or null) means the rule here; a number given is used as given."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlhf_dist.names import ESTIMATORS, REFERENCE_FREE_LOSSES

if TYPE_CHECKING:
    from rlhf_dist.config.rl import PPOConfig
    from rlhf_dist.config.schema import Config

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


def rollout_sequences_per_rank(p: PPOConfig, world_size: int) -> int:
    """Sequences one rank samples and scores per iteration: its share of the prompts
    (ppo.rollout_batch_size / world size, at least one) x ppo.samples_per_prompt."""
    return max(1, p.rollout_batch_size // world_size) * p.samples_per_prompt


def ppo_optimizer_steps(p: PPOConfig) -> int:
    """Optimizer steps per PPO iteration (data/batching.py PPOPlan): ppo_epochs passes
    over the rollout, one step per minibatch."""
    minibatch = ppo_minibatch_size(p.minibatch_size, p.rollout_batch_size, p.samples_per_prompt)
    return ppo_epochs(p.ppo_epochs, p.estimator) * (
        p.rollout_batch_size * p.samples_per_prompt // minibatch
    )


def old_logprobs_from_update(cfg: Config) -> bool:
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
    tokens from the old log-probs before the update, trainers/ppo/entropy.py), nor with
    ppo.routing_replay (scoring records or replays the routing). Read by the
    trainer and by the memory planner (a scoring phase without the actor's forward)."""
    p = cfg.ppo
    return (
        cfg.perf.old_logprobs_from_update
        and ppo_optimizer_steps(p) == 1
        and p.kl_placement == "loss"
        and not p.dynamic_sampling
        and p.overlong != "mask"
        and p.cov_control == "none"
        # routing replay records or replays in the scoring forward, and logs router metrics
        and p.routing_replay == "none"
    )


def has_critic(cfg: Config) -> bool:
    """A critic is built, trained and exported only for an estimator that reads values
    (algo/catalog.py needs_critic: gae)."""
    return ESTIMATORS[cfg.ppo.estimator].needs_critic


def needs_reference(cfg: Config) -> bool:
    """Whether PPO's KL term reads the reference: ppo.kl_coef > 0 (in the reward or the
    loss; the adaptive controller moves a coefficient that starts above 0). With 0 no
    reference is loaded or run, as TRL's GRPO with beta 0. With LoRA the reference is the
    actor's base with the adapters off: no second copy of the weights."""
    return cfg.ppo.kl_coef > 0


def shares_reward_with_critic(cfg: Config) -> bool:
    """A LoRA critic started from the reward model serves as the frozen reward model too
    (its adapters off): no separate reward model is loaded."""
    return (
        has_critic(cfg)
        and cfg.lora.critic
        and cfg.ppo.critic_init == "reward"
        and not cfg.reward.text_rewards()
    )


def reference_free(cfg: Config, stage: str) -> bool:
    """DPO with a loss that scores the policy alone (simpo, orpo): no reference model,
    no reference log-probs."""
    return stage == "dpo" and cfg.dpo.loss_type in REFERENCE_FREE_LOSSES


def precomputed_reference(cfg: Config, stage: str) -> bool:
    """DPO/KTO reference log-probs computed in one pass before training
    (reference_logprobs=precompute; none for a reference-free loss)."""
    section = getattr(cfg, stage)
    return section.reference_logprobs == "precompute" and not reference_free(cfg, stage)


def online_reference(cfg: Config, stage: str) -> bool:
    """DPO/KTO reference log-probs computed during training, beside each update's forward
    (reference_logprobs=online; none for a reference-free loss)."""
    section = getattr(cfg, stage)
    return section.reference_logprobs == "online" and not reference_free(cfg, stage)
