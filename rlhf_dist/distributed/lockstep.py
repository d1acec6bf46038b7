"""Forward-only loops in lock-step: the one way every rank scores its share of a list.

Each forward pass of a prepared model may be a collective: ZeRO-3 gathers every layer's
weights in it, DDP broadcasts buffers. Ranks whose shares need different numbers of passes
would leave the busiest one waiting for a pass that never comes (an SFT eval of 33 rows
in micro-batches of 8 on 2 ranks: 3 passes on rank 0, 2 on rank 1). So every
forward-only loop (evaluation of every stage, the reference precompute, the KTO reference
point, scoring, `rlhf-dist eval`) goes through `lockstep_map`: every rank runs as many
passes as the busiest one, throw-away passes on a filler chunk when it has run out of
rows (docs/architecture.md section 6). Uses only the Runtime's collectives.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from rlhf_dist.distributed.runtime import Runtime


def lockstep_slices(runtime: Runtime, n_items: int, size: int) -> Iterator[slice | None]:
    """Slices of `size` over this rank's `n_items`, then None until every rank is done.

    Every rank must iterate to the end: the number of passes is the maximum over ranks
    (one all-max), and a None asks for a throw-away pass.
    """
    mine = -(-n_items // size)
    total = int(runtime.all_max(torch.tensor(mine, dtype=torch.long)))
    for i in range(total):
        yield slice(i * size, (i + 1) * size) if i < mine else None


def lockstep_map(
    runtime: Runtime, share: Sequence, size: int, forward: Callable, filler: Sequence
) -> list:
    """forward(chunk) over this rank's `share` in chunks of `size`, in lock-step with the
    other ranks; returns the outputs of the real chunks, in order.

    filler: a chunk that is cheap to run (one short row) and whose output is thrown away;
    it is run while another rank still has chunks. Every rank must call this.
    """
    outputs = []
    for s in lockstep_slices(runtime, len(share), size):
        out = forward(share[s] if s else filler)
        if s:
            outputs.append(out)
    return outputs


def strided_map(
    runtime: Runtime, items: Sequence, size: int, forward: Callable, filler: Sequence
) -> list:
    """Every rank's results for `items`, in item order, on every rank.

    Each rank takes every world_size-th item (items[rank::world_size]) and runs
    forward(chunk) -> one picklable value per row (a list, or a tensor whose first
    dimension is the chunk's rows) in lock-step (`lockstep_map`); the per-item values are
    then gathered from all ranks and put back in item order. Every rank must call this.
    """
    mine = list(range(runtime.rank, len(items), runtime.world_size))
    chunks = lockstep_map(runtime, [items[i] for i in mine], size, forward, filler)
    values = [v for out in chunks for v in _rows(out)]
    gathered = runtime.gather_objects(list(zip(mine, values)))
    return [v for _, v in sorted(gathered, key=lambda pair: pair[0])]


def _rows(out: torch.Tensor | Iterable[Any]) -> list:
    """One plain value per row of a chunk's output (tensors moved to the CPU as lists)."""
    if isinstance(out, torch.Tensor):
        return out.detach().cpu().tolist()
    return list(out)
