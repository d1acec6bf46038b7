"""The weight-sync group of a rollout server (docs/serving.md): trainer rank 0 and the
`rlhf-dist serve` processes, a torch.distributed group of their own, outside the
trainers' default group.

The shape is the one vLLM-based peers use (TRL's vllm_serve, prime-rl): metadata over
HTTP, tensors by broadcast from rank 0. The group is built from a TCPStore that rank 0
hosts and a backend object made directly, so it never touches `torch.distributed`'s
global default group and a server can join the groups of several trainer runs, one after
the other. The backend is NCCL when trainer rank 0 and every server hold their weights
on CUDA (tensors go GPU to GPU, as TRL's and verl's NCCL groups send them), else gloo
(through CPU memory); `sync_backend` makes that choice from what each side offers
(`local_backends`, in the servers' /health). Every wait has a timeout
(distributed.timeout_s): a broadcast whose peer died raises, it never hangs (trl#2923;
NCCL's wait(timeout) blocks the host until the broadcast ends or the timeout passes).

Weights are announced and sent a bounded bucket at a time (`weight_buckets`); under ZeRO-3
or FSDP2 each bucket is gathered whole on its own (`whole_bucket`), never the whole model. Sizes
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
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from rlhf_dist.distributed import fsdp2
from rlhf_dist.distributed.process_exit import note_group

K = TypeVar("K")

# dtypes a weight may travel in (the names in the HTTP metadata).
DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


BACKENDS = ("gloo", "nccl")


def local_backends() -> list[str]:
    """The weight-sync backends this process can join: gloo always, NCCL where torch has
    it and a CUDA device is visible."""
    cuda = dist.is_nccl_available() and torch.cuda.is_available()
    return ["gloo", "nccl"] if cuda else ["gloo"]


def sync_backend(trainer_device: torch.device, offered: list[list[str]]) -> str:
    """The backend of a weight-sync group: "nccl" when trainer rank 0's weights are on
    CUDA (`trainer_device`), it can join NCCL itself and every server offers it
    (`offered`: each server's `local_backends`); else "gloo", which every side has."""
    cuda = trainer_device.type == "cuda" and "nccl" in local_backends()
    return "nccl" if cuda and all("nccl" in o for o in offered) else "gloo"


class SyncGroup:
    """One rank of a weight-sync group: `broadcast` from rank 0 (the trainer) to all.
    `device` is where its tensors travel from and into: the CPU under gloo, this
    process's current CUDA device under NCCL."""

    def __init__(
        self, address: str, port: int, rank: int, world_size: int, timeout_s: float,
        backend: str = "gloo",
    ) -> None:  # fmt: skip
        if backend not in BACKENDS:
            raise ValueError(f"weight sync: backend {backend!r} is not one of {BACKENDS}")
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.timeout = timedelta(seconds=timeout_s)
        # Rank 0 hosts the store; the others connect (retrying until the timeout).
        self.store = dist.TCPStore(
            address, port, world_size, rank == 0, timeout=self.timeout, wait_for_workers=False
        )
        # Built directly, not by init_process_group: no default group is created or used.
        if backend == "nccl":
            self.group = _nccl_group(self.store, rank, world_size, self.timeout)
            self.device = torch.device("cuda", torch.cuda.current_device())
            # NCCL makes its communicator at the first collective: made here, so that a
            # peer that never joins fails the join as gloo's rendezvous does.
            self.broadcast(torch.zeros(1, device=self.device))
        else:
            self.device = torch.device("cpu")
            self.group = dist.ProcessGroupGloo(self.store, rank, world_size, self.timeout)
        note_group()  # its worker threads and interpreter exit: process_exit.py

    def placed(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` as the group sends it: contiguous, on `device` (a copy where it is not
        there already; rank 0 only reads it)."""
        return tensor.detach().to(self.device).contiguous()

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Broadcast `tensor` (contiguous, on `device`) from rank 0 into every rank's
        `tensor`; raises after the timeout instead of waiting for a peer that is gone."""
        self.group.broadcast(tensor, 0, self.timeout).wait(self.timeout)
        return tensor


def _nccl_group(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> Any:
    """A ProcessGroupNCCL on `store` whose collectives time out after `timeout` (absent
    from CPU builds of torch, hence looked up by name)."""
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    if nccl is None or not torch.cuda.is_available():
        raise RuntimeError("weight sync: NCCL asked for, but this torch has no NCCL or no GPU")
    options = nccl.Options()
    options._timeout = timeout
    return nccl(store, rank, world_size, options)


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
def whole_bucket(params: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """Context yielding the whole tensor of each of `params` (a collective where they are
    sharded: every trainer rank enters with the same list). Under ZeRO-3 (parameters with
    ds_id) the parameters themselves, only these gathered in place for the body's
    duration; FSDP2's DTensor shards all-gathered into plain copies (fsdp2.full_tensor),
    freed when the body drops them; other tensors as they are."""
    partitioned = [p for p in params if hasattr(p, "ds_id")]
    if not partitioned:
        yield [fsdp2.full_tensor(p.detach()) for p in params]
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
        yield params
