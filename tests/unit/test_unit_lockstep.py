"""Unit tests of rlhf_dist.distributed.lockstep with a simulated second rank.

`TwoRanks(rank, other_share)` plays one rank of two: all_max returns the larger of its own
and the other rank's pass count, gather_objects puts the other rank's records (computed
here from the same forward) next to its own. The distributed test
(tests/distributed/test_dist_uneven_eval.py) runs the real collectives.
"""

import pytest
import torch

from rlhf_dist.distributed.lockstep import lockstep_map, strided_map


class TwoRanks:
    world_size = 2

    def __init__(self, rank: int, other_passes: int, other_records=()):
        self.rank, self.other_passes, self.other_records = rank, other_passes, list(other_records)

    def all_max(self, x: torch.Tensor) -> torch.Tensor:
        return torch.maximum(x, torch.tensor(self.other_passes))

    def gather_objects(self, items: list) -> list:
        parts = [list(items), self.other_records]
        return parts[0] + parts[1] if self.rank == 0 else parts[1] + parts[0]


def test_a_rank_with_fewer_rows_runs_throw_away_passes():
    seen = []

    def forward(chunk):
        seen.append(list(chunk))
        return sum(chunk)

    # 16 rows in chunks of 8 = 2 passes; the other rank (17 rows) needs 3.
    out = lockstep_map(TwoRanks(1, other_passes=3), list(range(16)), 8, forward, [-1])
    assert out == [sum(range(8)), sum(range(8, 16))]
    assert seen[-1] == [-1] and len(seen) == 3
    # The busiest rank runs no filler.
    seen.clear()
    lockstep_map(TwoRanks(0, other_passes=2), list(range(17)), 8, forward, [-1])
    assert len(seen) == 3 and [-1] not in seen


@pytest.mark.parametrize(("n", "size"), [(33, 8), (1, 4), (0, 3), (10, 1), (7, 16)])
def test_strided_map_returns_every_item_in_order(n, size):
    """Property: whatever the count and chunk size, every rank gets f(item) for every item,
    in item order, and tensors and lists come back alike."""
    items = [float(i) for i in range(n)]

    def forward(chunk):
        return torch.tensor(chunk) * 2

    other = list(range(1, n, 2))
    other_records = [(i, 2 * items[i]) for i in other]
    runtime = TwoRanks(0, other_passes=-(-len(other) // size), other_records=other_records)
    assert strided_map(runtime, items, size, forward, [0.0]) == [2 * x for x in items]
    as_lists = strided_map(runtime, items, size, lambda c: [2 * x for x in c], [0.0])
    assert as_lists == [2 * x for x in items]
