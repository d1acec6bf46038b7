"""The single door to Accelerate (and, through it, DeepSpeed).

Trainers never import accelerate or deepspeed themselves: they get a `Runtime` and call
its methods to prepare models, step optimizers and reduce statistics over ranks. Running
`python -m rlhf_dist ...` gives a one-process runtime; `accelerate launch` gives one
process per rank with the same code.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator

import torch


class Runtime:
    """Rank/world information, device placement and collectives of one training process."""

    def __init__(self, seed: int | None = None, num_threads: int = 0, timeout_s: int = 1800):
        from accelerate import Accelerator
        from accelerate.utils import InitProcessGroupKwargs

        kwargs = []
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available():
            # Without an explicit gloo backend on CPU, each process believes it is rank 0
            # of 1 while DeepSpeed partitions across all of them (design.md section 6).
            kwargs.append(
                InitProcessGroupKwargs(
                    backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)
                )
            )
        self.accelerator = Accelerator(kwargs_handlers=kwargs)
        if self.device.type == "cpu":
            local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            torch.set_num_threads(num_threads or max(1, _usable_cores() // local))
        if seed is not None:
            # The same seed on every rank: freshly initialised weights (a new value head)
            # must agree everywhere. Samplers that must differ use `seed_per_rank`.
            seed_everything(seed)

    def seed_per_rank(self, seed: int) -> None:
        """Seed this process's RNGs differently on every rank (rollout sampling)."""
        seed_everything(seed + 1_000_003 * self.rank)

    # --------------------------------------------------------------- who and where
    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    @property
    def world_size(self) -> int:
        return self.accelerator.num_processes

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    # ------------------------------------------------------------------- training
    def prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        """Wrap a trainable model and its optimizer for this run's backend."""
        return self.accelerator.prepare(model, optimizer)

    def prepare_frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        """Place a frozen inference-only model (reference, reward model) on this rank's device."""
        model.requires_grad_(False)
        model.eval()
        return model.to(self.device)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return self.accelerator.unwrap_model(model)

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss)

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module, sync: bool) -> Iterator[None]:
        """Skip the gradient all-reduce on micro-batches before the last of a step."""
        if sync:
            yield
        else:
            with self.accelerator.no_sync(model):
                yield

    def clip_grad_norm(self, parameters, max_norm: float) -> float:
        """Clip the gradients of `parameters` to `max_norm`; return the norm before clipping."""
        norm = self.accelerator.clip_grad_norm_(parameters, max_norm)
        return float(norm)

    # ---------------------------------------------------------------- collectives
    def all_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over all ranks (any shape); a copy, `x` is untouched."""
        if self.world_size == 1:
            return x.clone()
        return self.accelerator.reduce(x.clone(), reduction="sum")

    def all_max(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x.clone()
        out = x.clone()
        torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.MAX)
        return out

    def all_min(self, x: torch.Tensor) -> torch.Tensor:
        return -self.all_max(-x)

    def gather_objects(self, items: list) -> list:
        """Concatenate a python list from every rank (in rank order)."""
        if self.world_size == 1:
            return list(items)
        from accelerate.utils import gather_object

        return gather_object(items)

    def barrier(self) -> None:
        self.accelerator.wait_for_everyone()

    def print(self, *args, **kwargs) -> None:
        if self.is_main:
            print(*args, **kwargs, flush=True)


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch RNGs of this process."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def _usable_cores() -> int:
    """Cores this process may run on (the cgroup/affinity set, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
