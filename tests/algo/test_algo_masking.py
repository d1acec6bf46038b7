"""Tests for rlhf_dist.algo.masking (docs/algorithms.md: masked_mean, masked_var, masked_whiten)."""

import math

import pytest
import torch

from rlhf_dist.algo.masking import masked_mean, masked_var, masked_whiten

SEEDS = [0, 1, 2, 3]


# ---------------------------------------------------------------------------------------------
# float64 references: plain Python loops over the masked elements, no torch reductions.
# ---------------------------------------------------------------------------------------------


def ref_masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """sum(x*mask)/sum(mask) for a 2-D x, over all elements or along dim 0 / 1."""
    xs, ms = x.tolist(), mask.tolist()
    n_rows, n_cols = len(xs), len(xs[0])
    if dim is None:
        total, count = 0.0, 0
        for b in range(n_rows):
            for t in range(n_cols):
                if ms[b][t]:
                    total += xs[b][t]
                    count += 1
        return torch.tensor(total / count, dtype=torch.float64)
    dim = dim % 2
    out = []
    outer, inner = (n_cols, n_rows) if dim == 0 else (n_rows, n_cols)
    for i in range(outer):
        total, count = 0.0, 0
        for j in range(inner):
            b, t = (j, i) if dim == 0 else (i, j)
            if ms[b][t]:
                total += xs[b][t]
                count += 1
        out.append(total / count)
    return torch.tensor(out, dtype=torch.float64)


def _masked_values(x: torch.Tensor, mask: torch.Tensor) -> list:
    xs, ms = x.tolist(), mask.tolist()
    return [xs[b][t] for b in range(len(xs)) for t in range(len(xs[0])) if ms[b][t]]


def ref_masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    vals = _masked_values(x, mask)
    mean = sum(vals) / len(vals)
    ss = sum((v - mean) ** 2 for v in vals)
    return torch.tensor(ss / (len(vals) - 1 if unbiased else len(vals)), dtype=torch.float64)


def ref_masked_whiten(x, mask, keep_mean=False, eps=1e-8) -> torch.Tensor:
    vals = _masked_values(x, mask)
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)  # unbiased, per the contract
    xs, ms = x.tolist(), mask.tolist()
    out = [[0.0] * len(xs[0]) for _ in xs]
    for b in range(len(xs)):
        for t in range(len(xs[0])):
            if ms[b][t]:
                out[b][t] = (xs[b][t] - mean) / math.sqrt(var + eps) + (mean if keep_mean else 0.0)
    return torch.tensor(out, dtype=torch.float64)


def _close(actual, expected, atol=1e-6):
    torch.testing.assert_close(
        torch.as_tensor(actual).to(torch.float64), expected, atol=atol, rtol=1e-6
    )


def _random_x(batch, length, seed):
    g = torch.Generator().manual_seed(1000 + seed)
    # Non-zero mean and scale so whitening has something to remove.
    return 2.5 * torch.randn(batch, length, generator=g, dtype=torch.float64) + 1.5


# ---------------------------------------------------------------------------------------------
# Hand-computed literal cases
# ---------------------------------------------------------------------------------------------

# x = [[1, 2, 3], [4, 5, 6]], mask = [[T, T, F], [T, F, T]]  -> masked values 1, 2, 4, 6
_X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.float64)
_M = torch.tensor([[True, True, False], [True, False, True]])


def test_masked_mean_hand_computed():
    # all:   (1 + 2 + 4 + 6) / 4 = 13/4 = 3.25
    # dim=1: row0 (1 + 2)/2 = 1.5 ; row1 (4 + 6)/2 = 5.0
    # dim=0: col0 (1 + 4)/2 = 2.5 ; col1 2/1 = 2.0 ; col2 6/1 = 6.0
    _close(masked_mean(_X, _M), torch.tensor(3.25, dtype=torch.float64), atol=1e-12)
    _close(masked_mean(_X, _M, dim=1), torch.tensor([1.5, 5.0], dtype=torch.float64), atol=1e-12)
    _close(
        masked_mean(_X, _M, dim=0), torch.tensor([2.5, 2.0, 6.0], dtype=torch.float64), atol=1e-12
    )


def test_masked_var_hand_computed():
    # values 1, 2, 4, 6; mean 3.25; deviations -2.25, -1.25, 0.75, 2.75
    # squares 5.0625 + 1.5625 + 0.5625 + 7.5625 = 14.75
    # unbiased: 14.75 / 3 = 4.91666...; biased: 14.75 / 4 = 3.6875
    _close(masked_var(_X, _M), torch.tensor(14.75 / 3, dtype=torch.float64), atol=1e-12)
    _close(
        masked_var(_X, _M, unbiased=False), torch.tensor(3.6875, dtype=torch.float64), atol=1e-12
    )


def test_masked_whiten_hand_computed():
    # masked values 2, 4, 6 -> mean 4, unbiased var (4 + 0 + 4)/2 = 4, std 2
    # whitened: (2-4)/2 = -1, (4-4)/2 = 0, (6-4)/2 = 1; unmasked 99, -7, 5, 0 -> 0.
    # keep_mean adds 4 back: 3, 4, 5. (eps=1e-8 moves the std by ~2.5e-9: negligible.)
    x = torch.tensor([[2.0, 4.0, 99.0], [6.0, -7.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    expected = torch.tensor([[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    _close(masked_whiten(x, mask), expected, atol=1e-7)
    expected_keep = torch.tensor([[3.0, 4.0, 0.0], [5.0, 0.0, 0.0]], dtype=torch.float64)
    _close(masked_whiten(x, mask, keep_mean=True), expected_keep, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# Reference comparisons on ragged prefix masks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_masked_mean_matches_reference(seed, ragged_mask):
    x = _random_x(6, 9, seed)
    mask = ragged_mask(6, 9, seed)  # includes an all-False and an all-True row
    _close(masked_mean(x, mask), ref_masked_mean(x, mask))
    # dim=0: every column has >= 1 True thanks to the all-True row, so no 0/0.
    _close(masked_mean(x, mask, dim=0), ref_masked_mean(x, mask, dim=0))
    # Per-row means of an empty row are 0/0, which the contract leaves unspecified: use a
    # mask without an empty row for the per-row reduction.
    mask_rows = ragged_mask(6, 9, seed, empty_row=False)
    _close(masked_mean(x, mask_rows, dim=1), ref_masked_mean(x, mask_rows, dim=1))
    _close(masked_mean(x, mask_rows, dim=-1), ref_masked_mean(x, mask_rows, dim=1))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("unbiased", [True, False])
def test_masked_var_matches_reference(seed, unbiased, ragged_mask):
    x = _random_x(6, 9, seed)
    mask = ragged_mask(6, 9, seed)
    _close(masked_var(x, mask, unbiased=unbiased), ref_masked_var(x, mask, unbiased=unbiased))


def test_masked_var_default_is_unbiased(ragged_mask):
    x = _random_x(5, 8, 7)
    mask = ragged_mask(5, 8, 7)
    _close(masked_var(x, mask), ref_masked_var(x, mask, unbiased=True))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("keep_mean", [False, True])
def test_masked_whiten_matches_reference(seed, keep_mean, ragged_mask):
    x = _random_x(6, 9, seed)
    mask = ragged_mask(6, 9, seed)
    _close(masked_whiten(x, mask, keep_mean=keep_mean), ref_masked_whiten(x, mask, keep_mean))


# ---------------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_whiten_gives_zero_mean_unit_var_and_exact_zero_outside(seed, ragged_mask):
    x = _random_x(6, 9, seed)
    mask = ragged_mask(6, 9, seed)
    w = masked_whiten(x, mask)
    vals = torch.tensor(_masked_values(w, mask), dtype=torch.float64)
    assert abs(vals.mean().item()) < 1e-6
    # unbiased var of the whitened values is var/(var+eps) ~ 1 - eps/var
    assert abs(vals.var(unbiased=True).item() - 1.0) < 1e-6
    assert torch.all(w[~mask] == 0), "positions outside the mask must be exactly 0"


@pytest.mark.parametrize("seed", SEEDS)
def test_whiten_keep_mean_keeps_the_masked_mean(seed, ragged_mask):
    x = _random_x(6, 9, seed)
    mask = ragged_mask(6, 9, seed)
    w_keep = masked_whiten(x, mask, keep_mean=True)
    w = masked_whiten(x, mask)
    mean = sum(_masked_values(x, mask)) / int(mask.sum())
    assert sum(_masked_values(w_keep, mask)) / int(mask.sum()) == pytest.approx(mean, abs=1e-6)
    # keep_mean is exactly "whiten, then add the mean back" on masked positions ...
    _close(w_keep[mask], w[mask] + mean)
    # ... and still exactly 0 outside the mask.
    assert torch.all(w_keep[~mask] == 0)


@pytest.mark.parametrize("seed", SEEDS)
def test_padding_columns_do_not_change_statistics(seed, ragged_mask, pad_columns):
    # Garbage in extra all-padding columns must not leak into any statistic.
    x = _random_x(6, 9, seed)
    mask = ragged_mask(6, 9, seed)
    (x_pad,), mask_pad = pad_columns([x], mask, 4, seed)
    _close(masked_mean(x_pad, mask_pad), masked_mean(x, mask).to(torch.float64), atol=1e-12)
    _close(masked_var(x_pad, mask_pad), masked_var(x, mask).to(torch.float64), atol=1e-12)
    w_pad = masked_whiten(x_pad, mask_pad)
    _close(w_pad[:, :9], masked_whiten(x, mask).to(torch.float64), atol=1e-12)
    assert torch.all(w_pad[:, 9:] == 0)


def test_inputs_are_not_modified(ragged_mask):
    x = _random_x(6, 9, 11)
    mask = ragged_mask(6, 9, 11)
    x0, mask0 = x.clone(), mask.clone()
    masked_mean(x, mask)
    masked_mean(x, mask, dim=0)
    masked_var(x, mask)
    masked_var(x, mask, unbiased=False)
    masked_whiten(x, mask)
    masked_whiten(x, mask, keep_mean=True)
    assert torch.equal(x, x0)
    assert torch.equal(mask, mask0)


def test_float32_inputs_agree_with_reference(ragged_mask):
    # The trainer runs these in float32; same numbers to float32 precision.
    x = _random_x(6, 9, 5)
    mask = ragged_mask(6, 9, 5)
    x32 = x.float()
    _close(masked_mean(x32, mask), ref_masked_mean(x, mask), atol=1e-5)
    _close(masked_var(x32, mask), ref_masked_var(x, mask), atol=1e-5)
    _close(masked_whiten(x32, mask), ref_masked_whiten(x, mask), atol=1e-5)


# ---------------------------------------------------------------------------------------------
# last_token_index: the one "last real token", found from the mask alone.
# ---------------------------------------------------------------------------------------------


def test_last_token_index_hand_computed():
    from rlhf_dist.algo.masking import last_token_index

    mask = torch.tensor(
        [
            [1, 1, 1, 0, 0],  # right-padded: last real token at 2
            [0, 0, 1, 1, 1],  # left-padded prompt + response: at 4
            [0, 1, 0, 1, 0],  # holes: the last True wins, at 3
            [0, 0, 0, 0, 0],  # empty: 0 by contract
        ],
        dtype=torch.bool,
    )
    out = last_token_index(mask)
    assert out.tolist() == [2, 4, 3, 0] and out.dtype == torch.int64
    # The mask's dtype does not matter (attention masks are 0/1 integers).
    assert last_token_index(mask.long()).tolist() == [2, 4, 3, 0]


@pytest.mark.parametrize("seed", SEEDS)
def test_last_token_index_property(seed):
    """For any mask: the largest index holding True (0 for an empty row); for right-padded
    masks that is sum(mask) - 1, the count formula it replaces."""
    from rlhf_dist.algo.masking import last_token_index

    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(16, 11, generator=g) < 0.4
    expected = [max([t for t, m in enumerate(row) if m], default=0) for row in mask.tolist()]
    assert last_token_index(mask).tolist() == expected
    lengths = torch.randint(1, 12, (16,), generator=g)
    right = torch.arange(11) < lengths[:, None]
    assert torch.equal(last_token_index(right), right.sum(1) - 1)
