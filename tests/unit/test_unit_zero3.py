"""zero3.py's pure pieces: finding one flat span over gradients that tile a bucket.

The collective parts (whole weights, the all-reduce gradient reduction against
DeepSpeed's own reduce-scatter) run on 2 ranks in tests/distributed (grad_probe.py).
"""

from __future__ import annotations

import torch

from rlhf_dist.distributed.zero3 import _span


def carve(buffer: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """Consecutive views of `buffer` with the given sizes, as ZeRO-3 fills its bucket."""
    out, offset = [], 0
    for n in sizes:
        out.append(buffer.narrow(0, offset, n))
        offset += n
    return out


def test_tensors_tiling_a_buffer_in_any_order_give_one_view_and_their_starts():
    buffer = torch.arange(20.0)
    a, b, c = carve(buffer[2:], [4, 6, 8])  # the span starts 2 elements into the storage
    # ZeRO-3 lists a bucket's gradients in parameter order, not in bucket order.
    flat, starts = _span([c, a, b.view(2, 3)])
    assert flat is not None and flat.numel() == 18 and starts == [10, 0, 4]
    assert torch.equal(flat, buffer[2:])
    flat.mul_(2)  # a view, not a copy: the reduction happens where the gradients lie
    assert torch.equal(a, torch.tensor([4.0, 6.0, 8.0, 10.0]))


def test_tensors_that_do_not_tile_one_range_are_refused():
    buffer = torch.zeros(30)
    a, b, c = carve(buffer, [4, 6, 8])
    gap = buffer.narrow(0, 20, 2)  # two elements left out before it
    assert _span([a, b, c, gap]) == (None, [0, 4, 10, 18])
    overlap = buffer.narrow(0, 2, 4)
    assert _span([a, overlap])[0] is None
    assert _span([a, torch.zeros(6)])[0] is None  # another storage
    square = buffer.narrow(0, 9, 9).view(3, 3).t()  # not contiguous
    assert _span([carve(buffer, [9])[0], square])[0] is None
    assert _span([a, buffer.double().narrow(0, 4, 6)])[0] is None  # another dtype
