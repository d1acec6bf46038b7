"""The weight-sync group of a rollout server (docs/serving.md): trainer rank 0 and the
`rlhf-dist serve` processes, a torch.distributed group of their own, outside the
trainers' default group.

The shape is the one vLLM-based peers use (TRL's vllm_serve, prime-rl): metadata over
HTTP, tensors by broadcast from rank 0. The group is built from a TCPStore that rank 0
hosts and a gloo backend object made directly (tensors travel through CPU memory; an
NCCL group for GPU-to-GPU sends is not built yet), so it never touches `torch.distributed`'s global default group and a
server can join the groups of several trainer runs, one after the other. Every wait has
a timeout (distributed.timeout_s): a broadcast whose peer died raises, it never hangs
(trl#2923).

Weights are announced and sent a bounded bucket at a time (`weight_buckets`); under ZeRO-3
each bucket is gathered whole on its own (`whole_bucket`), never the whole model. Sizes
come from `ds_numel` where a parameter has one, the full size of a ZeRO-3 partition (whose
`numel()` is 0: trl PR#6386 sized buckets by it and gathered the whole model).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from rlhf_dist.distributed.process_exit import note_group

K = TypeVar("K")

# dtypes a weight may travel in (the names in the HTTP metadata).
DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class SyncGroup:
    """One rank of a weight-sync group: `broadcast` from rank 0 (the trainer) to all."""

    def __init__(self, address: str, port: int, rank: int, world_size: int, timeout_s: float):
        self.rank, self.world_size = rank, world_size
        self.timeout = timedelta(seconds=timeout_s)
        # Rank 0 hosts the store; the others connect (retrying until the timeout).
        self.store = dist.TCPStore(
            address, port, world_size, rank == 0, timeout=self.timeout, wait_for_workers=False
        )
        # Built directly, not by init_process_group: no default group is created or used.
        self.group = dist.ProcessGroupGloo(self.store, rank, world_size, self.timeout)
        note_group()  # its worker threads and interpreter exit: process_exit.py

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Broadcast `tensor` (contiguous, CPU) from rank 0 into every rank's `tensor`;
        raises after the timeout instead of waiting for a peer that is gone."""
        self.group.broadcast(tensor, 0, self.timeout).wait()
        return tensor


def memory_in_use(device: torch.device) -> int:
    """Bytes this process holds now: tensor memory on a GPU, else the resident set
    (/proc/self/statm; 0 where it cannot be read)."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class MemoryGrowth:
    """The largest growth of `read()` (memory_in_use by default) over its value at the
    start, sampled every `every_s` seconds on a thread while the `with` body runs.
    Sampling leaves the allocator's peak counters (the memory plan's per-phase peaks)
    alone; a spike shorter than `every_s` can be missed, which a gathered bucket, held for
    its broadcast, is not. On CPU the resident set only grows where the body needs pages
    the process does not hold yet (memory freed earlier and reused does not count)."""

    def __init__(
        self, device: torch.device, every_s: float = 0.005, read: Callable[[], int] | None = None
    ):
        self.read = read or (lambda: memory_in_use(device))
        self.every_s, self.peak_bytes = every_s, 0
        self._stop = threading.Event()

    def __enter__(self) -> MemoryGrowth:
        start = self.read()

        def sample() -> None:
            while not self._stop.wait(self.every_s):
                self.peak_bytes = max(self.peak_bytes, self.read() - start)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port free on `address` now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


def dtype_name(dtype: torch.dtype) -> str:
    """The metadata name of a dtype a weight may travel in; ValueError for others."""
    for name, d in DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"weight sync: dtype {dtype} cannot be sent (one of {sorted(DTYPES)})")


def _full_numel(param: torch.Tensor) -> int:
    """Elements of the whole parameter: ds_numel under ZeRO-3, where numel() is 0."""
    return int(getattr(param, "ds_numel", param.numel()))


def weight_buckets(
    named: Iterable[tuple[K, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[K, torch.Tensor]]]:
    """Consecutive (key, parameter) lists of about `bucket_bytes` of whole weights (a
    parameter larger than the bound is a bucket alone), counted in full sizes; the key
    (a name, or what a sync sends with it) travels along."""
    bucket: list[tuple[K, torch.Tensor]] = []
    size = 0
    for name, p in named:
        nbytes = _full_numel(p) * p.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, p))
        size += nbytes
    if bucket:
        yield bucket


@contextlib.contextmanager
def whole_bucket(params: list[torch.Tensor]) -> Iterator[None]:
    """The body reads whole tensors of `params`: under ZeRO-3 (parameters with ds_id) only
    these are gathered, for its duration (a collective: every trainer rank enters with
    the same list); elsewhere nothing happens."""
    partitioned = [p for p in params if hasattr(p, "ds_id")]
    if not partitioned:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
        yield
