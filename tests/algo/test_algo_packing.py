"""rlhf_dist.algo.packing (perf.packed_sequences, docs/architecture.md section 10): the
first-fit-decreasing bins and the packed layout, by hand and as properties."""

import pytest
import torch

from rlhf_dist.algo.packing import first_fit_decreasing, pack_tokens, packed_layout, unpack_tokens


def test_first_fit_decreasing_by_hand():
    # Longest first: 5 opens bin 0, 4 opens bin 1 (5 + 4 > 6), 3 opens bin 2, 2 joins
    # bin 1 (first with room), 1 joins bin 0; the empty item is left out.
    assert first_fit_decreasing([2, 5, 0, 3, 4, 1], 6) == [[1, 5], [4, 0], [3]]
    assert first_fit_decreasing([7, 1], 6) == [[0], [1]]  # too long: a bin of its own
    assert first_fit_decreasing([0, 0], 6) == []


@pytest.mark.parametrize("seed", range(6))
def test_first_fit_decreasing_properties(seed):
    g = torch.Generator().manual_seed(seed)
    capacity = int(torch.randint(4, 20, (1,), generator=g))
    lengths = torch.randint(
        0, capacity + 1, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g
    )
    lengths = lengths.tolist()
    bins = first_fit_decreasing(lengths, capacity)
    placed = sorted(i for b in bins for i in b)
    assert placed == [i for i, n in enumerate(lengths) if n > 0]  # each item once
    fills = [sum(lengths[i] for i in b) for b in bins]
    assert all(f <= capacity for f in fills)
    # First fit: a later bin's first item did not fit in any earlier bin then, so no two
    # bins could be merged into one.
    for i in range(len(bins)):
        for j in range(i + 1, len(bins)):
            assert fills[i] + fills[j] > capacity, (fills, i, j)
    assert len(bins) >= -(-sum(lengths) // capacity)


def test_packed_layout_by_hand():
    # Rows: left-padded, right-padded, left-padded to the end, empty, a single token.
    mask = torch.tensor(
        [[0, 0, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0], [0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0],
         [0, 0, 0, 1, 0, 0]]
    )  # fmt: skip
    gather, scatter, position_ids = packed_layout(mask, 6)
    # Lengths 3, 2, 5, 0, 1: bins [row 2, row 4] (5 + 1) and [row 0, row 1] (3 + 2).
    assert gather.tolist() == [[13, 14, 15, 16, 17, 27], [2, 3, 4, 6, 7, -1]]
    assert position_ids.tolist() == [[0, 1, 2, 3, 4, 0], [0, 1, 2, 0, 1, 0]]
    assert scatter.tolist() == [
        [-1, -1, 6, 7, 8, -1], [9, 10, -1, -1, -1, -1], [-1, 0, 1, 2, 3, 4],
        [-1] * 6, [-1, -1, -1, 5, -1, -1],
    ]  # fmt: skip
    x = torch.arange(30).reshape(5, 6)
    assert pack_tokens(x, gather).tolist() == [[13, 14, 15, 16, 17, 27], [2, 3, 4, 6, 7, 0]]
    assert torch.equal(unpack_tokens(pack_tokens(x, gather), scatter), x * mask)
    # Everything in one row (flash attention's layout): no padding slot.
    gather, _, position_ids = packed_layout(mask, 30)
    assert gather.shape == (1, 11) and bool((gather >= 0).all())
    assert position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 0]]


def random_mask(g, B, L):
    """Rows of random contiguous spans (left, right or both sides padded, some empty)."""
    mask = torch.zeros(B, L, dtype=torch.long)
    for b in range(B):
        n = int(torch.randint(0, L + 1, (1,), generator=g))
        start = int(torch.randint(0, L - n + 1, (1,), generator=g))
        mask[b, start : start + n] = 1
    return mask


@pytest.mark.parametrize("seed", range(6))
def test_packed_layout_properties(seed):
    g = torch.Generator().manual_seed(seed)
    B, L = (
        int(torch.randint(1, 12, (1,), generator=g)),
        int(torch.randint(1, 16, (1,), generator=g)),
    )
    mask = random_mask(g, B, L)
    gather, scatter, position_ids = packed_layout(mask, L)
    R, W = gather.shape
    assert W <= L and R <= B  # never wider, never more rows
    assert R * W <= B * L
    real = mask.bool()
    # Each real token exactly once, at the slot scatter names, with its padded position.
    assert sorted(gather[gather >= 0].tolist()) == real.flatten().nonzero().flatten().tolist()
    assert sorted(scatter[real].tolist()) == sorted(
        (gather.flatten() >= 0).nonzero().flatten().tolist()
    )
    assert bool((scatter[~real] == -1).all())
    expected = (mask.cumsum(1) - 1).clamp(min=0)
    assert torch.equal(position_ids.flatten()[scatter[real]], expected[real])
    # Padding only closes a packed row, and counts from 0 as a sequence of its own.
    pad = gather < 0
    assert bool((pad.long().diff(dim=1) >= 0).all())
    for r in range(R):
        n = int(pad[r].sum())
        assert position_ids[r, W - n :].tolist() == list(range(n))
    x = torch.randn(B, L, 3, dtype=torch.float64, generator=g)
    assert torch.equal(unpack_tokens(pack_tokens(x, gather), scatter), x * real[..., None])


def test_unpack_is_differentiable_and_zero_at_padding():
    mask = torch.tensor([[0, 1, 1], [1, 1, 0]])
    gather, scatter, _ = packed_layout(mask, 3)
    packed = torch.randn(*gather.shape, 2, requires_grad=True)
    unpack_tokens(packed, scatter).sum().backward()
    # Gradient 1 at each slot holding a real token, 0 at the slots of padding.
    assert torch.equal(packed.grad[..., 0], (gather >= 0).float())


def test_packed_layout_refuses_a_gap_inside_a_row():
    with pytest.raises(ValueError, match=r"contiguous; rows \[1\]"):
        packed_layout(torch.tensor([[1, 1, 0], [1, 0, 1]]), 3)
