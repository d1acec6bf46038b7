"""Unit tests of rlhf_dist.stats, on one process.

`FakeRuntime` stands in for rlhf_dist.distributed.Runtime: with one rank a reduction is
the identity, returned as a copy as Runtime does. Several ranks are the distributed
tests' job; here the point is the arithmetic (sums over counts, maxima, unbiased variance).
"""

import pytest
import torch

from rlhf_dist.algo.masking import masked_mean, masked_var
from rlhf_dist.stats import StatSums, global_mean_var


class FakeRuntime:
    world_size = 1
    rank = 0
    device = torch.device("cpu")

    def all_sum(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    def all_max(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()


def test_stat_sums_means_and_maxima():
    s = StatSums()
    s.add("policy/loss", torch.tensor(3.0), torch.tensor(2))
    s.add("policy/loss", 5.0, 6)
    s.add("objective/kl", torch.tensor(-1.5), 3)
    s.add_max("policy/ratio_max", torch.tensor(1.2))
    s.add_max("policy/ratio_max", 0.7)
    s.add_max("value/max", -4.0)
    out = s.reduce(FakeRuntime())
    # A mean of sums over counts (8 / 8), not a mean of per-call means ((1.5 + 0.83) / 2).
    assert out["policy/loss"] == pytest.approx(1.0)
    assert out["objective/kl"] == pytest.approx(-0.5)
    assert out["policy/ratio_max"] == pytest.approx(1.2)
    assert out["value/max"] == pytest.approx(-4.0)  # negative maxima survive
    assert set(out) == {"policy/loss", "objective/kl", "policy/ratio_max", "value/max"}


def test_stat_sums_zero_count_does_not_divide_by_zero():
    s = StatSums()
    s.add("objective/entropy", 0.0, 0)
    assert s.reduce(FakeRuntime()) == {"objective/entropy": 0.0}


def test_stat_sums_empty():
    assert StatSums().reduce(FakeRuntime()) == {}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_global_mean_var_matches_masked_stats_on_one_rank(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 9, generator=g) * 3 + 1
    mask = torch.rand(6, 9, generator=g) < 0.6
    mask[0] = False  # an empty row
    mask[1] = True  # a full row
    x[~mask] = 1e6  # padding garbage must not leak into either statistic
    mean, var = global_mean_var(FakeRuntime(), x, mask)
    assert mean.dtype == x.dtype and var.dtype == x.dtype
    torch.testing.assert_close(mean, masked_mean(x, mask), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(var, masked_var(x, mask, unbiased=True), rtol=1e-5, atol=1e-5)
    # And both equal the plain statistics of the selected elements.
    torch.testing.assert_close(mean, x[mask].mean(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(var, x[mask].var(unbiased=True), rtol=1e-5, atol=1e-5)


def test_global_moments_hand_computed_and_population_variance():
    from rlhf_dist.stats import global_moments

    x = torch.tensor([[1.0, 2.0, 99.0], [3.0, 6.0, -7.0]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    count, mean, sq_dev = global_moments(FakeRuntime(), x, mask)
    # Values 1, 2, 3, 6: mean 3, squared deviations 4 + 1 + 0 + 9 = 14.
    assert (float(count), float(mean), float(sq_dev)) == (4.0, 3.0, 14.0)
    assert mean.dtype == torch.float64
    mean, var = global_mean_var(FakeRuntime(), x, mask, unbiased=False)
    assert float(var) == pytest.approx(3.5) and float(mean) == 3.0
    # No mask: every element (the scores of a rollout).
    count, mean, _ = global_moments(FakeRuntime(), torch.tensor([2.0, 4.0]))
    assert (float(count), float(mean)) == (2.0, 3.0)


def test_joined_parts_reduce_bit_for_bit_like_one_accumulator():
    values = [0.1, 1e16, -1e16, 0.3, 2.5]  # float64 sums whose result depends on order
    one, parts = StatSums(), []
    for i, v in enumerate(values):
        one.add("x", v, 1)
        one.add_max("m", v)
        part = StatSums()
        part.add("x", v, 1)
        part.add_max("m", v)
        parts.append(part)
        if i == 2:
            parts.append(StatSums())  # an empty part changes nothing
    assert StatSums.joined(parts).reduce(FakeRuntime()) == one.reduce(FakeRuntime())
    assert parts[0].sums["x/sum"] == [0.1]  # the parts are left as they were
