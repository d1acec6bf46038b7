"""RunningMoments: online mean/variance equal to the statistics of everything seen."""

import pytest
import torch

from rlhf_dist.algo.masking import RunningMoments


def test_hand_computed_two_batches():
    # Batch 1: [1, 3] -> mean 2, population var 1. Batch 2: [5] -> mean 5, var 0.
    # All of [1, 3, 5]: mean 3, population var ((4 + 0 + 4) / 3) = 8/3.
    m = RunningMoments()
    m.update(2.0, 1.0, 2)
    m.update(5.0, 0.0, 1)
    assert m.mean == pytest.approx(3.0)
    assert m.var == pytest.approx(8 / 3)
    assert m.count == 3


@pytest.mark.parametrize("seed", range(4))
def test_equals_full_data_statistics(seed):
    g = torch.Generator().manual_seed(seed)
    batches = [
        torch.randn(int(n), generator=g, dtype=torch.float64) * 3 + 1
        for n in torch.randint(1, 20, (12,), generator=g)
    ]
    m = RunningMoments()
    for b in batches:
        m.update(float(b.mean()), float(b.var(unbiased=False)), b.numel())
    everything = torch.cat(batches)
    assert m.mean == pytest.approx(float(everything.mean()), abs=1e-9)
    assert m.var == pytest.approx(float(everything.var(unbiased=False)), rel=1e-9)


def test_empty_batch_changes_nothing_and_state_round_trips():
    m = RunningMoments()
    m.update(4.0, 2.0, 10)
    before = m.state_dict()
    m.update(100.0, 50.0, 0)
    assert m.state_dict() == before
    other = RunningMoments()
    other.load_state_dict(before)
    assert other.state_dict() == before
