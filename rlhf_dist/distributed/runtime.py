"""`Runtime`: the one object trainers hold, composing the distributed layer's pieces.

Each method hands over to the module that owns the concern (backend.py, guard.py,
collectives.py, training_state.py, inference.py, trackers.py); the logic lives there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from rlhf_dist.distributed import collectives, inference, training_state
from rlhf_dist.distributed import trackers as experiment_trackers
from rlhf_dist.distributed.backend import Backend, seed_everything
from rlhf_dist.distributed.guard import NumericalGuard
from rlhf_dist.distributed.sequence_parallel import sequence_group, sequence_parallel

if TYPE_CHECKING:
    from accelerate import Accelerator

T = TypeVar("T")
# What generation_context yields: (the module to generate with, keep_in_step or None).
GenerationModule = tuple[torch.nn.Module, Callable[[bool], bool] | None]


class Runtime:
    """Rank/world information, device placement, training steps and collectives."""

    def __init__(
        self,
        seed: int | None = None,
        num_threads: int = 0,
        timeout_s: int = 1800,
        dtype: str = "float32",
        trackers: tuple[str, ...] = (),
        logging_dir: str | None = None,
        sequence_parallel_size: int = 1,
    ):
        self.backend = Backend(num_threads, timeout_s, dtype, trackers, logging_dir)
        self.guard = NumericalGuard(self.backend)
        # distributed.sequence_parallel_size: this rank's group (sequence_parallel.py)
        self.sequence_group = sequence_group(self.world_size, self.rank, sequence_parallel_size)
        if seed is not None:
            # The same seed on every rank: freshly initialised weights (a new value head)
            # must agree everywhere. Samplers that must differ use `seed_per_rank`.
            seed_everything(seed)

    # --------------------------------------------------------------- who and where
    @property
    def accelerator(self) -> Accelerator:
        return self.backend.accelerator

    @property
    def rank(self) -> int:
        return self.backend.rank

    @property
    def world_size(self) -> int:
        return self.backend.world_size

    @property
    def is_main(self) -> bool:
        return self.backend.is_main

    @property
    def device(self) -> torch.device:
        return self.backend.device

    @property
    def zero_stage(self) -> int | None:
        """DeepSpeed ZeRO stage of this run, or None without DeepSpeed."""
        return self.backend.zero_stage

    @property
    def engine(self) -> str:
        """Which engine trains this run: zero0..zero3, fsdp2, ddp or single (Backend.engine)."""
        return self.backend.engine

    @property
    def zero_offload(self) -> str:
        """DeepSpeed's offload of this run: none, optimizer or all."""
        return self.backend.zero_offload

    def device_memory_bytes(self) -> int:
        return self.backend.device_memory_bytes()

    def seed_per_rank(self, seed: int) -> None:
        """Seed this process's RNGs differently on every rank (rollout sampling)."""
        seed_everything(seed + 1_000_003 * self.rank)

    def peak_memory_bytes(self) -> int:
        return self.backend.peak_memory_bytes()

    def start_phase_peak(self) -> None:
        self.backend.start_phase_peak()

    def phase_peak_bytes(self) -> int | None:
        return self.backend.phase_peak_bytes()

    def close(self) -> None:
        """Leave the process group together once the stage is done (collectives.close)."""
        collectives.close(self.backend)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """print() on the main process only, flushed."""
        if self.is_main:
            print(*args, **kwargs, flush=True)

    # ------------------------------------------------------------------- training
    def prepare(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        micro_batch_size: int,
        accumulation_steps: int,
        max_grad_norm: float,
        dtype: str,
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """Wrap a trainable model and its optimizer for this run's backend (Backend.prepare)."""
        return self.backend.prepare(
            model, optimizer, micro_batch_size, accumulation_steps, max_grad_norm, dtype
        )

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return self.backend.unwrap(model)

    def micro_backward(self, model: torch.nn.Module, loss: torch.Tensor, last: bool) -> bool:
        """Backward of one micro-batch, behind the numerical guard (guard.py)."""
        return self.guard.micro_backward(model, loss, last)

    def accumulating(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
        """Context for the forward and backward of a micro-batch that is not the step's
        last and may leave parameters unused (PPO-ptx's actor-only pass; guard.py)."""
        return self.guard.accumulating(model)

    def optimizer_step(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_norms: list[float]
    ) -> list[float] | None:
        """Clip, step and zero gradients; returns the pre-clip gradient norm of each param
        group, or None when the numerical guard skipped the step (non-finite loss on any
        rank, or without DeepSpeed a non-finite gradient): the step's gradients are discarded.

        max_norms: one per param group of the optimizer, e.g. actor and critic each with its
        own. DeepSpeed clips the global norm of all parameters at one max norm (its
        gradients are partitioned), so there every group reports that global norm.
        """
        return self.guard.optimizer_step(model, optimizer, max_norms)

    @property
    def skipped_steps(self) -> int:
        return self.guard.skipped_steps

    @property
    def bad_steps_in_row(self) -> int:
        return self.guard.bad_steps_in_row

    # ------------------------------------------------------- sequence parallelism
    @property
    def sequence_parallel_size(self) -> int:
        """distributed.sequence_parallel_size: ranks that split each sequence (1: off)."""
        return 1 if self.sequence_group is None else self.sequence_group.size

    def pool_micro_batches(self, items: list[T]) -> list[tuple[bool, T]]:
        """The micro-batches the ranks of this rank's sequence-parallel group run together,
        (whether this rank owns it, item), the same list on each of them; without
        sequence parallelism this rank's own items. Each is then run inside
        `sequence_parallel()`."""
        if self.sequence_group is None:
            return [(True, x) for x in items]
        mine = self.sequence_group.rank
        pooled = self.sequence_group.pool(items, self.device)
        return [(owner == mine, x) for owner, x in pooled]

    def sequence_parallel(self) -> contextlib.AbstractContextManager[None]:
        """Context for the forward of one pooled micro-batch: its columns split over the
        sequence-parallel group (engine/sequence_parallel.py); a no-op without it."""
        return sequence_parallel(self.sequence_group)

    # ------------------------------------------------- inference-only models
    def generation_context(
        self, model: torch.nn.Module, submodule: str | None = None, gather: bool = True
    ) -> contextlib.AbstractContextManager[GenerationModule]:
        """Yield (module, keep_in_step) for `engine.decode.generate` (inference.py)."""
        return inference.generation_context(self.backend, model, submodule, gather)

    def whole_weights(
        self, model: torch.nn.Module, enabled: bool = True
    ) -> contextlib.AbstractContextManager[None]:
        """Context: under ZeRO-3, `model`'s weights whole on every rank (one gather, no
        per-layer fetching) for the body, e.g. a rollout's scoring (inference.py)."""
        return inference.whole_weights_under_zero3(self.backend, model, enabled)

    def training_weights(
        self, model: torch.nn.Module, setting: str = "auto", name: str = "model"
    ) -> contextlib.AbstractContextManager[None]:
        """Context around `model`'s training steps: under ZeRO-3, per
        perf.gather_for_training, its weights gathered whole once per optimizer
        step instead of layer by layer in every forward and backward (inference.py)."""
        return inference.training_weights(self.backend, model, setting, name)

    @staticmethod
    def local_loading() -> contextlib.AbstractContextManager[None]:
        """Load models whole in this process, even after ZeRO-3 engines exist."""
        return inference.local_loading()

    def prepare_frozen(
        self,
        model: torch.nn.Module,
        placement: str = "auto",
        dtype: str = "float32",
        name: str = "frozen model",
    ) -> torch.nn.Module:
        """A frozen inference-only model (reference, reward model) for this backend."""
        return inference.prepare_frozen(self.backend, model, placement, dtype, name)

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """bf16 autocast when bf16 was asked for without DeepSpeed (fp32 weights, bf16
        compute; docs/distributed.md, precision); otherwise a no-op. Trainable models'
        prepared forwards run under it already; rollouts, which call the unwrapped
        modules, enter it themselves."""
        return self.accelerator.autocast()

    # ---------------------------------------------------------------- collectives
    def all_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over all ranks (any shape, returned on x's device); `x` is untouched."""
        return collectives.all_sum(self.backend, x)

    def all_max(self, x: torch.Tensor) -> torch.Tensor:
        return collectives.all_max(self.backend, x)

    def any_rank(self, flag: bool) -> bool:
        """Whether `flag` holds on any rank (a collective: every rank must call it)."""
        return collectives.any_rank(self.backend, flag)

    def gather_objects(self, items: list) -> list:
        """Concatenate a python list from every rank (in rank order)."""
        return collectives.gather_objects(self.backend, items)

    def barrier(self) -> None:
        collectives.barrier(self.backend)

    # ------------------------------------------------------- full / consolidated state
    def full_state_dict(self, model: torch.nn.Module) -> dict | None:
        """The full state dict on the main process, None elsewhere (training_state.py)."""
        return training_state.full_state_dict(self.backend, model)

    def gather_training_state(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict | None:
        """World-size independent training state, on the main process (training_state.py)."""
        return training_state.gather_training_state(self.backend, model, optimizer)

    def restore_optimizer_state(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        state: dict | None,
        shards: Path | None = None,
    ) -> None:
        """Put a checkpoint's optimizer state into a prepared model's optimizer: `state`
        (read_training_state's or a consolidated checkpoint's) or, where that is None
        under FSDP2, the DCP checkpoint `shards` read into the weights and moments."""
        if state is None and shards is not None:
            return training_state.load_sharded_state(self.backend, model, optimizer, shards)
        assert state is not None, "a checkpoint's training state or its shards"
        return training_state.restore_optimizer_state(self.backend, model, optimizer, state)

    def sharded_state_writer(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> Callable[[Path], None] | None:
        """Under FSDP2, what writes the training state into a checkpoint's directory as
        DCP shards (every rank calls it; training_state.save_sharded_state); None where
        the state is gathered (gather_training_state) and written whole."""
        if not training_state.writes_shards(self.backend):
            return None
        return lambda d: training_state.save_sharded_state(self.backend, model, optimizer, d)

    def read_training_state(self, shards: Path) -> dict | None:
        """A DCP checkpoint's training state read whole by this rank, before `prepare`;
        None under FSDP2, which reads only its own shards after (restore_optimizer_state)."""
        if training_state.writes_shards(self.backend):
            return None
        return training_state.read_full_state(shards)

    # ------------------------------------------------------------------ trackers
    def start_trackers(self, project: str, config: dict, init_kwargs: dict) -> None:
        experiment_trackers.start_trackers(self.backend, project, config, init_kwargs)

    def log_scalars(self, values: dict, step: int) -> None:
        experiment_trackers.log_scalars(self.backend, values, step)

    def tracker(self, name: str) -> Any:
        """The tracker object itself (a wandb run, a SummaryWriter; trackers.py)."""
        return experiment_trackers.tracker(self.backend, name)

    def finish_trackers(self) -> None:
        experiment_trackers.finish_trackers(self.backend)
