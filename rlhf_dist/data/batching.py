"""Numbers derived from the config and the world size, and batch index plans.

The config holds what the user asked for (global batch sizes, per-rank micro-batches);
this module derives per-rank counts once, so no loop recomputes them and nothing is
written back to the config.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from rlhf_dist.config import PPOConfig, StageConfig, sizes


@dataclass(frozen=True)
class BatchPlan:
    """How one global batch of `global_size` sequences is cut across ranks and micro-batches."""

    global_size: int
    world_size: int
    micro_batch_size: int
    micro_batch_tokens: int = 0  # token budget of a micro-batch; 0: micro_batch_size rows

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

    def micro_batches(self, widths: Sequence, rank: int, rows_per_item: int = 1) -> list[list[int]]:
        """This rank's micro-batches as lists of indices into its share of the global batch.

        Without a token budget: `micro_slices` as index lists. With one: `token_budget_split`
        of the share's widths into as many micro-batches as the busiest rank needs (under
        ZeRO-3 every forward/backward is a collective). widths: one per item of the WHOLE
        global batch (every rank holds it), so every rank computes every rank's count
        without a collective. rows_per_item: padded rows per item (a pair stacks 2).
        """
        if not self.micro_batch_tokens:
            return [list(range(s.start, s.stop)) for s in self.micro_slices()]
        shares = [list(widths[self.rank_slice(r)]) for r in range(self.world_size)]
        budget = self.micro_batch_tokens
        parts = max(len(token_budget_split(w, budget, 1, rows_per_item)) for w in shares)
        return token_budget_split(shares[rank], budget, parts, rows_per_item)


def _width(widths: list[tuple[int, ...]], group: list[int]) -> int:
    """Padded width of a micro-batch: the sum over parts of each part's longest row."""
    return sum(max(widths[i][k] for i in group) for k in range(len(widths[group[0]])))


def token_budget_split(
    widths: Sequence, budget: int, parts: int = 1, rows_per_item: int = 1
) -> list[list[int]]:
    """Indices 0..n-1 cut into micro-batches by a token budget (docs/architecture.md
    section 10, "token-budget micro-batches").

    widths: per item an int (its length) or a tuple of lengths of separately padded parts
    (a rollout row: (prompt, response), left- and right-padded), so a micro-batch of
    items g costs len(g) x rows_per_item x sum over parts of the part's longest. Items are
    taken longest first (ties by index: deterministic) and added to the current
    micro-batch while its cost stays <= budget; an item over the budget by itself goes
    alone. Then, while there are fewer than `parts` micro-batches, the costliest one with
    2+ items is halved (a part of a micro-batch never costs more), so ranks can run the
    same number of passes. Every index is in exactly one micro-batch; needs parts <= n.
    """
    items = [tuple(w) if isinstance(w, (tuple, list)) else (int(w),) for w in widths]
    if not 1 <= parts <= max(len(items), 1):
        raise ValueError(f"cannot cut {len(items)} items into {parts} micro-batches")
    order = sorted(range(len(items)), key=lambda i: (-sum(items[i]), i))
    groups: list[list[int]] = []
    for i in order:
        if (
            groups
            and (len(groups[-1]) + 1) * rows_per_item * _width(items, groups[-1] + [i]) <= budget
        ):
            groups[-1].append(i)
        else:
            groups.append([i])
    while len(groups) < parts:
        splittable = [j for j, g in enumerate(groups) if len(g) > 1]
        j = max(splittable, key=lambda j: (len(groups[j]) * _width(items, groups[j]), -j))
        half = (len(groups[j]) + 1) // 2
        groups[j : j + 1] = [groups[j][:half], groups[j][half:]]
    return groups


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


def ppo_plan(ppo_cfg: PPOConfig, world_size: int) -> PPOPlan:
    """PPO's plan with the config's auto sizes resolved (config/sizes.py)."""
    p = ppo_cfg
    minibatch = sizes.ppo_minibatch_size(
        p.minibatch_size, p.rollout_batch_size, p.samples_per_prompt
    )
    micro = sizes.micro_batch_size(p.micro_batch_size, minibatch, world_size)
    return PPOPlan(
        rollout=BatchPlan(p.rollout_batch_size, world_size, p.rollout_micro_batch_size),
        update=BatchPlan(minibatch, world_size, micro, p.micro_batch_tokens),
        ppo_epochs=sizes.ppo_epochs(p.ppo_epochs, p.estimator),
        samples_per_prompt=p.samples_per_prompt,
    )


def stage_plan(section: StageConfig, world_size: int) -> BatchPlan:
    """The step loop's plan of sft/rm/dpo/kto: the global batch across ranks, in
    micro-batches of the section's micro_batch_size (auto: config/sizes.py)."""
    micro = sizes.micro_batch_size(section.micro_batch_size, section.batch_size, world_size)
    return BatchPlan(section.batch_size, world_size, micro, section.micro_batch_tokens)


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """A permutation of range(n), the same on every rank for the same (seed, epoch)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def global_batches(
    n: int, batch_size: int, seed: int, epochs: int
) -> Iterator[tuple[int, list[int]]]:
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
