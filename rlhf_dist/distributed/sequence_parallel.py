"""Ulysses sequence parallelism's collectives (DeepSpeed-Ulysses, Jacobs et al. 2023,
arXiv:2309.14509; docs/distributed.md "Sequence parallelism").

distributed.sequence_parallel_size = n splits the world into groups of n consecutive
ranks. The ranks of a group pool their micro-batches (`SequenceGroup.pool`); for each
pooled micro-batch every rank of the group runs the model on a contiguous 1/n of its
columns. Attention needs the whole sequence: an all-to-all before it turns (all heads,
1/n of the positions) into (1/n of the heads, all positions), and one after it turns
the output back (`scatter_heads`, `gather_heads`). The per-position log-probs of the
slices are then put together on every rank of the group (`gather_columns`), so the loss
code sees whole sequences. All three are autograd functions whose backward is the
matching collective, so every rank of a group must run the same forwards and backwards
in the same order.

Why our own glue and not Accelerate's ParallelismConfig(sp_backend="deepspeed"): see
docs/distributed.md; in short, Accelerate wires DeepSpeed's UlyssesSPAttentionHF only
inside its DeepSpeed prepare (nothing on CPU/DDP), shards batches through its own
DataLoader adapter (we micro-batch ourselves and shard prompts per rank for
generation), and that attention ignores the attention mask (causal by position ids
only), which left-padded rollout rows need.
"""

from __future__ import annotations

import contextlib
import contextvars
import io
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from rlhf_dist.errors import ConfigError

T = TypeVar("T")


@dataclass(frozen=True)
class SequenceGroup:
    """This rank's sequence-parallel group: `size` ranks, this one at `rank` within it,
    `group` the torch process group (None only for a group of one, in tests)."""

    size: int
    rank: int
    group: object

    def pool(self, items: list[T], device: torch.device | str | None = None) -> list[tuple[int, T]]:
        """Every item of every rank of the group, as (owner's rank in the group, item),
        in rank order then each rank's own order: the same list on every rank of the
        group. Items are serialised by torch.save (any picklable structure of tensors)
        and the other ranks' tensors loaded onto `device` (pickled GPU tensors would land
        on the sender's device index); this rank's own items are kept as they are."""
        if self.size == 1:
            return [(0, x) for x in items]
        buffer = io.BytesIO()
        torch.save(items, buffer)
        parts: list[bytes] = [b""] * self.size
        dist.all_gather_object(parts, buffer.getvalue(), group=self.group)
        # (a CPU rank's device may read "cpu:0", which torch.load does not take)
        where = None if device is None or torch.device(device).type == "cpu" else device
        pooled: list[tuple[int, T]] = []
        for owner, part in enumerate(parts):
            if owner == self.rank:
                pooled += [(owner, x) for x in items]
                continue
            theirs = torch.load(io.BytesIO(part), map_location=where, weights_only=False)
            pooled += [(owner, x) for x in theirs]
        return pooled


def sequence_group(world_size: int, rank: int, size: int) -> SequenceGroup | None:
    """This rank's group of `size` consecutive ranks (every rank creates every group, as
    torch.distributed.new_group requires); None for size 1. A world size that `size`
    does not divide is a ConfigError."""
    if size <= 1:
        return None
    if world_size % size:
        raise ConfigError(
            f"distributed.sequence_parallel_size={size} must divide the world size {world_size}"
        )
    mine = None
    for start in range(0, world_size, size):
        ranks = list(range(start, start + size))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = SequenceGroup(size, rank - start, group)
    return mine


_ACTIVE: contextvars.ContextVar[SequenceGroup | None] = contextvars.ContextVar(
    "rlhf_dist_sequence_group", default=None
)


@contextlib.contextmanager
def sequence_parallel(group: SequenceGroup | None) -> Iterator[None]:
    """Forwards inside run sequence-parallel over `group` (engine/sequence_parallel.py);
    None: a no-op. Only a pooled micro-batch (`SequenceGroup.pool`) may run inside: every
    rank of the group must pass the same rows."""
    token = _ACTIVE.set(group)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_group() -> SequenceGroup | None:
    """The group of the enclosing `sequence_parallel` block, or None."""
    return _ACTIVE.get()


def _all_to_all(x: torch.Tensor, group: object) -> torch.Tensor:
    """x (n, ...): block k goes to rank k of the group; returns (n, ...), block k from
    rank k."""
    x = x.contiguous()
    out = torch.empty_like(x)  # contiguous too: empty_like keeps a view's strides
    dist.all_to_all_single(out, x, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """`_all_to_all` with its backward: with equal blocks the exchange is its own
    inverse, so the gradient goes back by the same exchange."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: object) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_to_all(grad, ctx.group), None


def scatter_heads(x: torch.Tensor, sg: SequenceGroup) -> torch.Tensor:
    """(B, h, S, d) -> (B, h/n, n*S, d): this rank's slice of the positions for all heads
    in, the group's heads block `sg.rank` over all positions (slices in rank order) out."""
    B, h, S, d = x.shape
    n = sg.size
    if n == 1:
        return x
    send = x.reshape(B, n, h // n, S, d).transpose(0, 1)  # block k: heads block k
    recv = _AllToAll.apply(send, sg.group)  # block k: rank k's positions, my heads
    return recv.permute(1, 2, 0, 3, 4).reshape(B, h // n, n * S, d)


def gather_heads(y: torch.Tensor, sg: SequenceGroup) -> torch.Tensor:
    """The inverse of `scatter_heads`: (B, h/n, L, d) -> (B, h, L/n, d)."""
    B, hl, L, d = y.shape
    n = sg.size
    if n == 1:
        return y
    send = y.reshape(B, hl, n, L // n, d).permute(2, 0, 1, 3, 4)  # block k: positions k
    recv = _AllToAll.apply(send, sg.group)  # block k: rank k's heads, my positions
    return recv.transpose(0, 1).reshape(B, n * hl, L // n, d)


class _GatherColumns(torch.autograd.Function):
    """(R, W) per rank -> (R, n*W), rank k's columns at [k*W, (k+1)*W). Every rank of the
    group then computes the same loss from the whole rows, so each holds the same
    gradient of every column: the backward takes their average (all-reduce / n, which
    also keeps a rank from trusting its own copy alone) and keeps its own columns. The
    loss is thus counted once per group, as without sequence parallelism."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sg: SequenceGroup) -> torch.Tensor:
        ctx.sg, ctx.width = sg, x.shape[1]
        parts = [torch.empty_like(x) for _ in range(sg.size)]
        dist.all_gather(parts, x.contiguous(), group=sg.group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.sg.group)
        grad /= ctx.sg.size
        w, r = ctx.width, ctx.sg.rank
        return grad[:, r * w : (r + 1) * w], None


def gather_columns(x: torch.Tensor, sg: SequenceGroup) -> torch.Tensor:
    """Each rank's (R, W) columns put together in rank order, (R, n*W), differentiable."""
    return x if sg.size == 1 else _GatherColumns.apply(x, sg)
