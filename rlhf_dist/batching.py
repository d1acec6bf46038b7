"""Numbers derived from the config and the world size, and batch index plans.

The config holds what the user asked for (global batch sizes, per-rank micro-batches);
this module derives per-rank counts once, so no loop recomputes them and nothing is
written back to the config.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BatchPlan:
    """How one global batch of `global_size` sequences is cut across ranks and micro-batches."""

    global_size: int
    world_size: int
    micro_batch_size: int

    @property
    def per_rank(self) -> int:
        return self.global_size // self.world_size

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per rank per optimizer step (the last may be smaller)."""
        return -(-self.per_rank // self.micro_batch_size)

    def micro_slices(self) -> list[slice]:
        """Slices of a rank's share of the batch, one per micro-batch."""
        m = self.micro_batch_size
        return [slice(i, min(i + m, self.per_rank)) for i in range(0, self.per_rank, m)]

    def rank_slice(self, rank: int) -> slice:
        return slice(rank * self.per_rank, (rank + 1) * self.per_rank)


@dataclass(frozen=True)
class PPOPlan:
    """Per-iteration counts of PPO (docs/architecture.md section 5)."""

    rollout: BatchPlan  # prompts per iteration (each sampled n times), cut across ranks
    update: BatchPlan  # sequences per optimizer step, in training micro-batches
    ppo_epochs: int
    samples_per_prompt: int = 1  # n: a rank samples each of its prompts n times

    @property
    def sequences(self) -> int:
        """Sequences per iteration over all ranks: prompts x n."""
        return self.rollout.global_size * self.samples_per_prompt

    @property
    def minibatches_per_epoch(self) -> int:
        return self.sequences // self.update.global_size

    @property
    def optimizer_steps_per_iteration(self) -> int:
        return self.ppo_epochs * self.minibatches_per_epoch


def ppo_plan(ppo_cfg, world_size: int) -> PPOPlan:
    return PPOPlan(
        rollout=BatchPlan(ppo_cfg.rollout_batch_size, world_size, ppo_cfg.rollout_micro_batch_size),
        update=BatchPlan(ppo_cfg.minibatch_size, world_size, ppo_cfg.micro_batch_size),
        ppo_epochs=ppo_cfg.ppo_epochs,
        samples_per_prompt=ppo_cfg.samples_per_prompt,
    )


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """A permutation of range(n), the same on every rank for the same (seed, epoch)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def global_batches(n: int, batch_size: int, seed: int, epochs: int):
    """Yield (epoch, indices) of full global batches over `epochs` shuffled passes."""
    for epoch in range(epochs):
        order = epoch_order(n, seed, epoch)
        for start in range(0, n - batch_size + 1, batch_size):
            yield epoch, order[start : start + batch_size]


def extra_batch(n: int, batch_size: int, seed: int, iteration: int, round_: int) -> list[int]:
    """Indices of the global batch of dynamic sampling's extra round `round_` (1, 2, ...)
    of `iteration`: `batch_size` distinct prompts of n, drawn at random from all of them.

    A function of (seed, iteration, round) only, the same on every rank: a resumed run
    draws the same extra prompts without any saved state, and the main stream
    (global_batches) is the same with or without dynamic sampling.
    """
    mixed = ((seed * 1_000_003 + iteration) * 1_009 + round_) % 2**62 + 2**62
    g = torch.Generator().manual_seed(mixed)  # offset: never an epoch_order seed
    return torch.randperm(n, generator=g)[:batch_size].tolist()
