"""Unit tests of rlhf_dist.batching: how global batches split over ranks and micro-batches.

Loss normalisation (docs/architecture.md section 4) relies on every sequence of a global batch being
seen exactly once across ranks and micro-batches, so that property is checked exhaustively
over a grid of sizes rather than on one example.
"""

import itertools
import random
from types import SimpleNamespace

import pytest

from rlhf_dist.data.batching import (
    BatchPlan,
    PPOPlan,
    epoch_order,
    global_batches,
    ppo_plan,
    token_budget_split,
)

# (world size, per-rank size, micro-batch size); global = world * per-rank, as validate() asks.
GRID = [
    (world, per_rank, micro)
    for world, per_rank, micro in itertools.product([1, 2, 3, 4], [1, 2, 5, 8, 12], [1, 3, 4, 8])
]


@pytest.mark.parametrize(("world", "per_rank", "micro"), GRID)
def test_batch_plan_covers_every_index_once(world, per_rank, micro):
    plan = BatchPlan(global_size=world * per_rank, world_size=world, micro_batch_size=micro)
    assert plan.per_rank == per_rank
    slices = plan.micro_slices()
    assert len(slices) == plan.accumulation_steps == -(-per_rank // micro)
    seen = []
    for rank in range(world):
        share = list(range(plan.global_size))[plan.rank_slice(rank)]
        assert len(share) == per_rank
        for s in slices:
            micro_batch = share[s]
            # Non-empty, never larger than asked; only the last may be smaller.
            assert 0 < len(micro_batch) <= micro
            seen.extend(micro_batch)
        assert all(len(share[s]) == micro for s in slices[:-1])
    assert sorted(seen) == list(range(plan.global_size))
    assert len(seen) == plan.global_size


def test_batch_plan_by_hand():
    plan = BatchPlan(global_size=12, world_size=2, micro_batch_size=4)
    assert plan.per_rank == 6
    assert plan.accumulation_steps == 2
    assert plan.micro_slices() == [slice(0, 4), slice(4, 6)]
    assert plan.rank_slice(0) == slice(0, 6) and plan.rank_slice(1) == slice(6, 12)


def test_ppo_plan_counts():
    cfg = SimpleNamespace(
        rollout_batch_size=64,
        rollout_micro_batch_size=8,
        minibatch_size=16,
        micro_batch_size=4,
        micro_batch_tokens=0,
        ppo_epochs=3,
        samples_per_prompt=1,
        estimator="gae",
    )
    plan = ppo_plan(cfg, world_size=2)
    assert isinstance(plan, PPOPlan)
    assert plan.rollout == BatchPlan(64, 2, 8)
    assert plan.update == BatchPlan(16, 2, 4)
    assert plan.rollout.per_rank == 32 and plan.rollout.accumulation_steps == 4
    assert plan.update.per_rank == 8 and plan.update.accumulation_steps == 2
    assert plan.minibatches_per_epoch == 4
    assert plan.optimizer_steps_per_iteration == 12


def test_ppo_plan_counts_sequences_with_several_samples_per_prompt():
    # 8 prompts x 4 samples = 32 sequences; minibatches of 16 sequences -> 2 per epoch.
    cfg = SimpleNamespace(
        rollout_batch_size=8,
        rollout_micro_batch_size=8,
        minibatch_size=16,
        micro_batch_size=4,
        micro_batch_tokens=0,
        ppo_epochs=2,
        samples_per_prompt=4,
        estimator="grpo",
    )
    plan = ppo_plan(cfg, world_size=2)
    assert plan.rollout.per_rank == 4  # prompts per rank
    assert plan.sequences == 32
    assert plan.minibatches_per_epoch == 2
    assert plan.optimizer_steps_per_iteration == 4


def test_epoch_order_is_a_deterministic_permutation():
    n = 50
    first = epoch_order(n, seed=3, epoch=0)
    assert sorted(first) == list(range(n))
    # Same (seed, epoch) on another rank or a resumed run: the same order.
    assert epoch_order(n, seed=3, epoch=0) == first
    # A shuffle, not the identity (a 50-element identity permutation is ~1/50! likely).
    assert first != list(range(n))
    orders = {tuple(epoch_order(n, seed=3, epoch=e)) for e in range(5)}
    assert len(orders) == 5  # every epoch reshuffles
    assert epoch_order(n, seed=4, epoch=0) != first  # the seed matters


def test_global_batches_yield_only_full_batches():
    n, batch_size, epochs = 10, 3, 2
    out = list(global_batches(n, batch_size, seed=0, epochs=epochs))
    assert [e for e, _ in out] == [0, 0, 0, 1, 1, 1]
    assert all(len(b) == batch_size for _, b in out)
    for epoch in range(epochs):
        idx = [i for e, b in out if e == epoch for i in b]
        # No index twice within an epoch; exactly n % batch_size left out.
        assert len(set(idx)) == len(idx) == n - n % batch_size
        # The batches are consecutive slices of that epoch's order.
        assert idx == epoch_order(n, 0, epoch)[: len(idx)]


def test_global_batches_fewer_rows_than_a_batch():
    assert list(global_batches(2, 3, seed=0, epochs=4)) == []
    exact = list(global_batches(6, 3, seed=1, epochs=1))
    assert len(exact) == 2
    assert sorted(exact[0][1] + exact[1][1]) == list(range(6))


# ---------------------------------------------------------- token-budget micro-batches


def budget_cost(widths, group, rows_per_item=1) -> int:
    """Padded cells of a micro-batch: rows x the sum over parts of each part's longest."""
    parts = [w if isinstance(w, tuple) else (w,) for w in widths]
    width = sum(max(parts[i][k] for i in group) for k in range(len(parts[group[0]])))
    return len(group) * rows_per_item * width


def test_token_budget_split_by_hand():
    # longest first: 2 (8), 0 (5), 1 (3), 3 (2), 4 (2); 0 and 1 cost 2 x 5 = 10 <= 10
    assert token_budget_split([5, 3, 8, 2, 2], 10) == [[2], [0, 1], [3, 4]]
    # a row over the budget by itself goes alone
    assert token_budget_split([20, 3, 3], 10) == [[0], [1, 2]]
    # pairs stack 2 rows each: 2 x 2 x 3 = 12 fits, 2 x 3 x 3 = 18 does not
    assert token_budget_split([3, 3, 3], 12, rows_per_item=2) == [[0, 1], [2]]
    # (prompt, response): left- and right-padded parts, each padded to its own longest;
    # rows 2 and 3 cost 2 x (5 + 3) = 16, rows 1 and 2 2 x (5 + 5) = 20
    rollout = [(5, 7), (3, 5), (5, 3), (3, 1)]
    assert token_budget_split(rollout, 16) == [[0], [1], [2, 3]]
    # equalised to 4 passes: the costliest micro-batch of 2+ rows is halved
    assert token_budget_split(rollout, 16, parts=4) == [[0], [1], [2], [3]]
    # equal costs: the first is halved
    assert token_budget_split([4, 4, 4, 4], 100, parts=3) == [[0], [1], [2, 3]]
    with pytest.raises(ValueError, match="micro-batches"):
        token_budget_split([1, 2], 10, parts=3)


@pytest.mark.parametrize("seed", range(40))
def test_token_budget_split_properties(seed):
    """Every row in exactly one micro-batch, each within the budget unless it is one row
    over it, rows longest first in a deterministic order, at least `parts` micro-batches
    and no more than the budget alone needs."""
    rng = random.Random(seed)
    n = rng.randint(1, 24)
    two_parts = seed % 2 == 0
    widths = [
        (rng.randint(1, 20), rng.randint(1, 30)) if two_parts else rng.randint(1, 40)
        for _ in range(n)
    ]
    budget, rows_per_item = rng.randint(1, 200), rng.choice([1, 2])
    parts = rng.randint(1, n)
    groups = token_budget_split(widths, budget, parts, rows_per_item)
    flat = [i for g in groups for i in g]
    assert sorted(flat) == list(range(n))
    total = [sum(w) if two_parts else w for w in widths]
    assert flat == sorted(range(n), key=lambda i: (-total[i], i))
    for g in groups:
        assert g and (len(g) == 1 or budget_cost(widths, g, rows_per_item) <= budget)
    greedy = len(token_budget_split(widths, budget, 1, rows_per_item))
    assert len(groups) == max(parts, greedy)
    assert token_budget_split(widths, budget, parts, rows_per_item) == groups


def test_batch_plan_micro_batches_same_count_on_every_rank():
    widths = [9, 1, 1, 1, 9, 9, 1, 1]  # rank 0: one long row; rank 1: two
    plan = BatchPlan(8, 2, 4, micro_batch_tokens=10)
    groups = [plan.micro_batches(widths, rank) for rank in range(2)]
    assert groups[1] == [[0], [1], [2, 3]]  # 9 and 9 one each, then the two 1s
    assert groups[0] == [[0], [1, 2], [3]]  # [0] [1, 2, 3] would do; halved to three passes
    assert len(groups[0]) == len(groups[1])
    off = BatchPlan(8, 2, 3)
    assert off.micro_batches(widths, 1) == [[0, 1, 2], [3]]
