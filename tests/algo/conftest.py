"""Shared input factories for the rlhf_dist.algo tests.

Kept as fixtures (not an importable helper module) so the tests work whatever import mode
or rootdir pytest uses: tests/algo has no __init__.py, and fixtures need no import path.
The float64 reference implementations live next to the tests that use them, on purpose:
each is a plain Python loop that shares no code with the module under test.
"""

import random

import pytest
import torch


def _ragged_mask(batch: int, length: int, seed: int, empty_row: bool = True) -> torch.Tensor:
    """(batch, length) bool prefix mask, like a real response mask.

    Every row has a different number of True positions (a different response length):
    one row is all True (response fills the window), one is all False when `empty_row`
    (empty response), the others have distinct lengths in [1, length-1]. Rows are shuffled
    so the special rows are not always at the same index.
    """
    rng = random.Random(seed)
    lengths = [length] + ([0] if empty_row else [])
    n_middle = batch - len(lengths)
    assert 0 <= n_middle <= length - 1, "need distinct lengths: batch too large for length"
    lengths += rng.sample(range(1, length), n_middle)
    rng.shuffle(lengths)
    mask = torch.zeros(batch, length, dtype=torch.bool)
    for b, n in enumerate(lengths):
        mask[b, :n] = True
    return mask


def _pad_columns(tensors, mask, n_extra: int, seed: int):
    """Append `n_extra` columns to every (B, T) tensor and to the mask.

    The new mask columns are all False (pure padding); the new tensor columns hold garbage
    of moderate size. Garbage is kept finite and |x| <= ~10 on purpose: the contract's
    masked mean is sum(x*mask)/sum(mask), and inf*0 = nan, so overflow-level garbage would
    test something the contract does not promise.
    """
    g = torch.Generator().manual_seed(seed)
    out = []
    for x in tensors:
        junk = 3.0 * torch.randn(x.shape[0], n_extra, generator=g, dtype=torch.float64) + 2.0
        out.append(torch.cat([x, junk.to(x.dtype)], dim=1))
    pad_mask = torch.zeros(mask.shape[0], n_extra, dtype=torch.bool)
    return out, torch.cat([mask, pad_mask], dim=1)


@pytest.fixture
def ragged_mask():
    return _ragged_mask


@pytest.fixture
def pad_columns():
    return _pad_columns
