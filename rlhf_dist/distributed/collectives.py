"""Reductions and gathers over ranks, and telling a dead peer from any other error.

Every function here is a collective: every rank must call it, in the same order. With one
rank each is a copy (never the caller's own tensor), so callers may modify the result.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlhf_dist.distributed.backend import Backend


def all_sum(backend: Backend, x: torch.Tensor) -> torch.Tensor:
    """Sum of `x` over all ranks (any shape, returned on x's device); `x` is untouched."""
    return _all_reduce(backend, x, "SUM")


def all_max(backend: Backend, x: torch.Tensor) -> torch.Tensor:
    """Elementwise maximum of `x` over all ranks (any shape, on x's device)."""
    return _all_reduce(backend, x, "MAX")


def _all_reduce(backend: Backend, x: torch.Tensor, op: str) -> torch.Tensor:
    """`op`: a ReduceOp name, looked up only with several ranks (torch builds without
    torch.distributed have no ReduceOp)."""
    if backend.world_size == 1:
        return x.clone()
    # gloo/NCCL reduce on the backend's device; the result goes back where x lives.
    out = x.detach().to(backend.device, copy=True)
    torch.distributed.all_reduce(out, op=getattr(torch.distributed.ReduceOp, op))
    return out.to(x.device)


def any_rank(backend: Backend, flag: bool) -> bool:
    """Whether `flag` holds on any rank."""
    return bool(all_max(backend, torch.tensor(float(flag), device=backend.device)) > 0)


def gather_objects(backend: Backend, items: list) -> list:
    """Concatenate a python list from every rank (in rank order)."""
    if backend.world_size == 1:
        return list(items)
    from accelerate.utils import gather_object

    return gather_object(items)


def barrier(backend: Backend) -> None:
    backend.accelerator.wait_for_everyone()


_PEER_FAILURE_SIGNS = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Connection refused",
    "Broken pipe",
    "Timed out",
    "timed out",
    "Socket Timeout",
    "NCCL communicator was aborted",
    "DistBackendError",
)


def collective_failure(exc: BaseException) -> str | None:
    """One line describing a collective that failed because another rank died or hung
    (gloo/NCCL report it as a RuntimeError after distributed.timeout_s at the latest)."""
    import torch.distributed as dist

    text = str(exc)
    is_dist = isinstance(exc, getattr(dist, "DistError", ())) or any(
        sign in text for sign in _PEER_FAILURE_SIGNS
    )
    if not is_dist or not dist.is_available() or not dist.is_initialized():
        return None
    first = " ".join(text.split())[:300]
    return f"lost contact with another rank (it died, was killed or hangs; see its log): {first}"


# Teardowns close() runs after its last barrier, while the process group still exists.
_BEFORE_DESTROY: list[Callable[[], None]] = []


def before_destroy(teardown: Callable[[], None]) -> None:
    """Have close() call `teardown` before it destroys the process group: a library that
    made groups of its own over ours (vLLM's engine) must release them first, or its exit
    hook later fails on groups that no longer exist."""
    if teardown not in _BEFORE_DESTROY:
        _BEFORE_DESTROY.append(teardown)


def close(backend: Backend) -> None:
    """Wait for every rank, then destroy the process group: left to interpreter exit, the
    teardown of gloo's still-joinable threads can abort a rank that has finished its work
    ("terminate called without an active exception", exit -6), failing a good run."""
    import torch.distributed as dist

    if backend.world_size > 1 and dist.is_available() and dist.is_initialized():
        dist.barrier()
        while _BEFORE_DESTROY:
            _BEFORE_DESTROY.pop()()
        if dist.is_initialized():  # a teardown may have destroyed it already
            dist.destroy_process_group()
