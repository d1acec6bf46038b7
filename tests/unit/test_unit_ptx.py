"""PPO-ptx's row stream (rlhf_dist/trainers/ppo/ptx.py), on one process without a model.

`FakeRuntime` stands in for rlhf_dist.distributed.Runtime: a rank of a world whose
all_sum returns the local value (the count of several ranks is the distributed code's
job); what is checked here is which rows each step, rank and micro-batch gets, and that
a stream resumed at a position continues where the unbroken one was.
"""

from __future__ import annotations

import pytest
import torch

from rlhf_dist.data.batching import BatchPlan, global_batches
from rlhf_dist.data.rows import SFTExample
from rlhf_dist.trainers.ppo.ptx import PtxStream

PAD = 0


class FakeRuntime:
    device = torch.device("cpu")

    def __init__(self, rank: int = 0, world_size: int = 1):
        self.rank, self.world_size = rank, world_size

    def all_sum(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()


def examples(n: int = 10) -> list[SFTExample]:
    """Row i: ids [i+1] x (2 + i % 3), prompt of 1 token, so i % 3 + 1 trained tokens and
    its first id names it."""
    return [SFTExample([i + 1] * (2 + i % 3), 1) for i in range(n)]


def rows_of(step) -> list[list[int]]:
    """The rows (by their first id - 1) of each micro-batch of a PtxStep."""
    return [(b["input_ids"][:, 0] - 1).tolist() for b in step.micro]


def test_a_step_takes_the_next_global_batch_in_the_asked_number_of_micro_batches():
    rows = examples()
    stream = PtxStream(rows, BatchPlan(4, 1, 4), coef=0.5, seed=3, pad_id=PAD)
    expected = [idx for _, idx in global_batches(len(rows), 4, 3, epochs=3)]
    for k, parts in enumerate([1, 2, 4, 3, 1, 2]):  # past the end of an epoch (2 per epoch)
        step = stream.next_step(FakeRuntime(), parts)
        got = rows_of(step)
        assert len(got) == parts and all(got), got  # no empty micro-batch
        assert sum(got, []) == expected[k]  # in order, each row once
        trained = sum(len(rows[i].ids) - 1 for i in expected[k])
        assert float(step.count) == trained  # the global count of trained tokens
        assert sum(int(b["loss_mask"].sum()) for b in step.micro) == trained
        assert stream.position == k + 1
    assert step.coef == 0.5


def test_ranks_share_the_global_batch_without_overlap():
    rows, plan = examples(), BatchPlan(4, 2, 2)
    whole = PtxStream(rows, BatchPlan(4, 1, 4), 1.0, 0, PAD).next_step(FakeRuntime(), 1)
    shares = [
        sum(rows_of(PtxStream(rows, plan, 1.0, 0, PAD).next_step(FakeRuntime(r, 2), 2)), [])
        for r in range(2)
    ]
    assert shares[0] + shares[1] == rows_of(whole)[0]
    assert len(shares[0]) == len(shares[1]) == 2


@pytest.mark.parametrize("position", [0, 1, 5])
def test_a_stream_resumed_at_its_position_continues_the_unbroken_one(position):
    rows = examples()
    unbroken = PtxStream(rows, BatchPlan(4, 1, 4), 1.0, 7, PAD)
    for _ in range(position):
        unbroken.next_step(FakeRuntime(), 1)
    resumed = PtxStream(rows, BatchPlan(4, 1, 4), 1.0, 7, PAD, position=position)
    for _ in range(3):
        a, b = unbroken.next_step(FakeRuntime(), 2), resumed.next_step(FakeRuntime(), 2)
        assert rows_of(a) == rows_of(b)
    assert resumed.position == unbroken.position == position + 3


def test_more_micro_batches_than_rows_is_refused():
    stream = PtxStream(examples(), BatchPlan(4, 2, 2), 1.0, 0, PAD)
    with pytest.raises(ValueError, match="2 ptx rows into 3"):
        stream.next_step(FakeRuntime(0, 2), 3)
