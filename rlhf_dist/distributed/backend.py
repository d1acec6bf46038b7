"""The Accelerator of this process, built once from our config, and who and where we are.

Also the one place that hands models to the backend (`prepare`, `unwrap`): under DeepSpeed
the "auto" entries of its config are filled from ours first (deepspeed_config.py).
"""

from __future__ import annotations

import datetime
import os
import random
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rlhf_dist.distributed import fsdp2
from rlhf_dist.distributed.deepspeed_config import (
    fill_deepspeed_config,
    fill_gloo_zero3,
    fill_zero_buckets,
    resolve_deepspeed_file,
)
from rlhf_dist.distributed.fsdp2 import fsdp_launch
from rlhf_dist.distributed.process_exit import note_group

if TYPE_CHECKING:
    from accelerate import Accelerator


class Backend:
    """Accelerate's Accelerator plus rank/world information and model preparation."""

    def __init__(
        self,
        num_threads: int = 0,
        timeout_s: int = 1800,
        dtype: str = "float32",
        trackers: tuple[str, ...] = (),
        logging_dir: str | None = None,
    ):
        self.accelerator = _make_accelerator(timeout_s, dtype, trackers, logging_dir)
        if self.world_size > 1:
            note_group()  # gloo's worker threads and interpreter exit: process_exit.py
        if self.device.type == "cpu":
            torch.set_num_threads(num_threads or default_threads())
        self._unwrapped: dict[int, tuple] = {}  # id -> (wrapper, kept alive; inner module)
        self._earlier_peak = 0  # the GPU allocator's peak before the last phase reset

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

    @property
    def zero_stage(self) -> int | None:
        """DeepSpeed ZeRO stage of this run, or None without DeepSpeed."""
        plugin = self.accelerator.state.deepspeed_plugin
        if plugin is None:
            return None
        return int(plugin.deepspeed_config.get("zero_optimization", {}).get("stage", 0))

    @property
    def engine(self) -> str:
        """Which engine trains this run: "zero0".."zero3" (DeepSpeed), "fsdp2", "ddp"
        (several ranks, neither) or "single" (one process)."""
        if self.zero_stage is not None:
            return f"zero{self.zero_stage}"
        if fsdp_launch() and self.world_size > 1:
            return "fsdp2"
        return "ddp" if self.world_size > 1 else "single"

    @property
    def zero_offload(self) -> str:
        """What the DeepSpeed config offloads to CPU memory: none, optimizer (its states)
        or all (ZeRO-3 weights as well; FSDP2's fsdp_offload_params)."""
        plugin = self.accelerator.state.deepspeed_plugin
        if plugin is None:
            return "all" if self.engine == "fsdp2" and fsdp2.offloads_params() else "none"
        zero = plugin.deepspeed_config.get("zero_optimization", {})

        def offloads(name: str) -> bool:
            return str(zero.get(name, {}).get("device", "none")) not in ("none", "None")

        if offloads("offload_param"):
            return "all"
        return "optimizer" if offloads("offload_optimizer") else "none"

    def device_memory_bytes(self) -> int:
        """Memory one rank may fill with tensors: the GPU's total, or on CPU the host's
        (`host_memory_budget`) shared by this machine's ranks."""
        if self.device.type == "cuda":
            return int(torch.cuda.get_device_properties(self.device).total_memory)
        return host_memory_budget(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))

    def prepare(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        micro_batch_size: int,
        accumulation_steps: int,
        max_grad_norm: float,
        dtype: str,
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """Wrap a trainable model and its optimizer for this run's backend: (the model, a
        DeepSpeed engine or DDP wrapper as the backend has it; the optimizer, in
        Accelerate's wrapper). Under FSDP2 the model is sharded in place and the torch
        optimizer, pointed at the shards, comes back as it is (fsdp2.py).

        Under DeepSpeed the "auto" entries of its config are filled from ours (one place
        for each value); an explicit value that disagrees is a ConfigError.
        """
        if self.engine == "fsdp2":
            return fsdp2.shard_model(model, optimizer, self.device, dtype), optimizer
        if self.zero_stage is not None:
            ds = self.accelerator.state.deepspeed_plugin.deepspeed_config
            fill_deepspeed_config(
                ds, micro_batch_size, accumulation_steps, self.world_size, max_grad_norm, dtype
            )
            fill_zero_buckets(ds, model)
            if self.zero_stage == 3:
                fetch_whole_layers(model)
                if self.device.type == "cpu":
                    fill_gloo_zero3(ds)
        prepared = self.accelerator.prepare(model, optimizer)
        if self.zero_stage == 3 and self.world_size > 1 and self.device.type == "cpu":
            from rlhf_dist.distributed.zero3 import reduce_gradients_by_all_reduce

            reduce_gradients_by_all_reduce()
        return prepared

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model inside its backend wrapper, cached (Accelerate's unwrap walks the
        module tree on every call; it ran once per optimizer step)."""
        key = id(model)
        if key not in self._unwrapped:
            self._unwrapped[key] = (model, self.accelerator.unwrap_model(model))
        return self._unwrapped[key][1]

    def peak_memory_bytes(self) -> int:
        """Peak memory of this rank over the run: the accelerator's allocator peak, or the
        process's peak resident set on CPU."""
        if self.device.type == "cuda":
            return max(self._earlier_peak, int(torch.cuda.max_memory_allocated(self.device)))
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux

    def start_phase_peak(self) -> None:
        """Start measuring one phase's peak (GPU: the allocator's peak counter, reset; the
        run's peak so far is kept for peak_memory_bytes). CPU: nothing to measure."""
        if self.device.type == "cuda":
            self._earlier_peak = self.peak_memory_bytes()
            torch.cuda.reset_peak_memory_stats(self.device)

    def phase_peak_bytes(self) -> int | None:
        """This rank's peak tensor memory since start_phase_peak (GPU), or None on CPU,
        where the process's resident peak covers the whole run and not one phase."""
        if self.device.type != "cuda":
            return None
        return int(torch.cuda.max_memory_allocated(self.device))


def fetch_whole_layers(model: torch.nn.Module) -> None:
    """Make ZeRO-3 fetch and release each decoder layer as one unit ("leaf" modules).

    By default ZeRO-3 hooks every submodule: a Llama layer's ~12 modules each run their
    own pre/post-forward and pre/post-backward hooks and gather their own few tensors.
    The layer classes are the ones transformers itself never splits (`_no_split_modules`);
    one gather per layer per pass, no hooks inside it. Must run before the engine exists.
    """
    from deepspeed.utils import set_z3_leaf_modules

    if any(hasattr(m, "lora_A") for m in model.modules()):
        # peft's adapter layers inside a leaf layer lose their gathered weights before
        # backward ("size of tensor a (0) must match"): LoRA keeps per-module fetching.
        return
    names = {n for m in model.modules() for n in (getattr(m, "_no_split_modules", None) or ())}
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    if classes:
        set_z3_leaf_modules(model, sorted(classes, key=lambda c: c.__name__))


def mark_leaf_modules(model: torch.nn.Module, classes: list[type]) -> int:
    """Make every module of `classes` inside `model` a ZeRO-3 leaf: fetched and released
    as one unit, its submodules never hooked on their own; returns how many were marked
    (0 and nothing imported outside a DeepSpeed launch, where leaves mean nothing).

    For mixture-of-experts blocks whose experts run only on the tokens routed to them
    (docs/moe.md): per-module fetching would make each rank gather the experts its own
    tokens chose, in its own order, so ranks whose tokens route differently wait on
    collectives the others never join. Gathered as one unit, every rank fetches every
    expert of the block at the same point. Must run before the engine exists (its hooks
    read the mark when they are registered).
    """
    if not classes or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return 0
    from deepspeed.utils import set_z3_leaf_modules

    return len(set_z3_leaf_modules(model, classes))


def _make_accelerator(
    timeout_s: int, dtype: str, trackers: tuple[str, ...], logging_dir: str | None
) -> Accelerator:
    """The Accelerator of this process: gloo on CPU ranks with our timeout, bf16 mixed
    precision when model.dtype is bfloat16, and the experiment trackers asked for."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    resolve_deepspeed_file()  # the shipped configs name their DeepSpeed file relatively
    if fsdp_launch():
        fsdp2.check_fsdp_config()  # before any model loads
    handlers = []
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        timeout = datetime.timedelta(seconds=timeout_s)
        # Without an explicit gloo backend on CPU, each process believes it is rank 0
        # of 1 while DeepSpeed partitions across all of them (docs/architecture.md section 6).
        backend = None if torch.cuda.is_available() else "gloo"
        handlers.append(InitProcessGroupKwargs(backend=backend, timeout=timeout))
    # bf16 weights -> the backends' bf16 mixed precision (DeepSpeed: bf16.enabled, with
    # fp32 master weights in the optimizer); decided here, once, from our config.
    precision = "bf16" if dtype == "bfloat16" else None
    # Without a GPU and without DeepSpeed, tell Accelerate so: otherwise torchrun-started
    # CPU ranks are not wrapped in DDP and silently drift apart.
    use_ds = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    # (An FSDP launch on CPU ranks is also one for Accelerate: it applies FSDP to GPUs
    # only; fsdp2.py shards the models itself and never hands them to Accelerate.)
    cpu = not torch.cuda.is_available() and not use_ds
    if not torch.cuda.is_available():
        # DeepSpeed's CPU accelerator counts its "devices" by running `numactl` in a
        # subprocess unless LOCAL_SIZE is set, and ZeRO-3 asks on every gradient
        # reduce-scatter: thousands of forks per PPO iteration of a deep model.
        os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if use_ds:
            _skip_shm_allreduce_op()
    tracking = {}
    if trackers:
        from accelerate.utils import ProjectConfiguration

        # TensorBoard event files go to <logging_dir>/<project>; W&B uses its own dir.
        project = ProjectConfiguration(project_dir=logging_dir, logging_dir=logging_dir)
        tracking = {"log_with": list(trackers), "project_config": project}
    return Accelerator(kwargs_handlers=handlers, mixed_precision=precision, cpu=cpu, **tracking)


def _skip_shm_allreduce_op() -> None:
    """Keep DeepSpeed's CPU backend from building its shared-memory allreduce op.

    DeepSpeed's TorchBackend JIT-compiles that op (deepspeed/ops/csrc/cpu/comm/shm.cpp) in
    every process group it builds on CPU: a long C++ build on a machine's first launch,
    then a /dev/shm segment per rank that DeepSpeed never unlinks. Only
    `inference_all_reduce` (DeepSpeed's tensor-parallel inference) uses it; ZeRO and our
    collectives go through torch.distributed's gloo. Marking the op incompatible is the
    switch TorchBackend itself reads (`build_shm_op`: None for an incompatible op)."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch RNGs of this process."""
    import numpy as np

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def default_threads() -> int:
    """CPU threads of this process when perf.num_threads is 0: the usable cores divided
    among the ranks on this machine (oversubscribed OpenMP threads spin-wait). A single
    process takes OMP_NUM_THREADS where it is set (a shared node, a test runner with
    several workers); with several local ranks the launcher sets that variable to 1 by
    itself (torchrun), so there it says nothing of the user's wish."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    given = os.environ.get("OMP_NUM_THREADS", "")
    if local == 1 and given.isdigit() and int(given) > 0:
        return int(given)
    return max(1, _usable_cores() // local)


def _usable_cores() -> int:
    """Cores this process may run on (the cgroup/affinity set, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def host_memory_budget(local_ranks: int = 1) -> int:
    """Bytes of tensors one of this machine's `local_ranks` CPU ranks may hold: physical
    memory or, inside a container or any memory cgroup, its limit if lower; less what the
    processes hold already (interpreter, libraries: memory the plan's tensors do not
    include), counted as this process's resident set on each rank."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = min(physical, cgroup_memory_limit() or physical)
    local_ranks = max(1, local_ranks)
    return max(0, limit - local_ranks * resident_bytes()) // local_ranks


def resident_bytes() -> int:
    """This process's resident set (bytes), from /proc/self/statm; 0 where there is none."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def cgroup_memory_limit() -> int | None:
    """The lowest memory limit (bytes) on this process's cgroup and its ancestors, cgroup
    v2 (`memory.max`) or v1 (`memory.limit_in_bytes`); None where nothing is limited or
    /proc and /sys say nothing (not Linux)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            root, name = Path("/sys/fs/cgroup"), "memory.max"
        elif "memory" in controllers.split(","):
            root, name = Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"
        else:
            continue
        here = Path(path)
        for level in (here, *here.parents):  # a parent's limit binds its children too
            try:
                text = (root / level.relative_to("/") / name).read_text().strip()
            except (OSError, ValueError):
                continue
            if text.isdigit() and int(text) < 2**60:  # v1 writes "no limit" as ~2**63
                limits.append(int(text))
    return min(limits) if limits else None
