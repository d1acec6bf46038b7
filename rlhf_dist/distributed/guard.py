"""Backward passes and optimizer steps, behind the numerical guard.

A step whose loss (on any rank) or, without DeepSpeed, whose gradient is not finite is
skipped on every rank: its gradients are discarded and counted, so one bad batch does
not poison the weights. `TrainingDiverged` ends a run the guard cannot save.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import TYPE_CHECKING

import torch

from rlhf_dist.distributed import fsdp2, zero3
from rlhf_dist.distributed.backend import Backend
from rlhf_dist.distributed.collectives import all_max
from rlhf_dist.errors import TrainingDiverged

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine


class NumericalGuard:
    """Per-step guard state: whether the current step saw a non-finite value, and counts."""

    def __init__(self, backend: Backend):
        self._backend = backend
        self._poisoned, self._steps_seen = False, 0
        self.skipped_steps, self.bad_steps_in_row = 0, 0

    def micro_backward(self, model: torch.nn.Module, loss: torch.Tensor, last: bool) -> bool:
        """Backward of one micro-batch; gradients are reduced over ranks on the `last` one.

        If the loss is not finite on ANY rank (all ranks agree, before any backward
        collective), this and the step's remaining backward passes are skipped and
        `optimizer_step` discards the step. Returns whether backward ran.
        """
        backend = self._backend
        loss = _inject_nan(loss, self._steps_seen + 1, backend.rank)
        bad = torch.tensor(0.0 if bool(torch.isfinite(loss.detach()).all()) else 1.0)
        if all_max(backend, bad) > 0:
            self._poisoned = True
        if self._poisoned:
            return False
        if backend.zero_stage is not None:
            engine = model
            engine.set_gradient_accumulation_boundary(last)
            # Our loss is already divided by the global count: no 1/GAS scaling on top.
            engine.backward(loss, scale_wrt_gas=False)
        elif last or backend.world_size == 1 or backend.engine == "fsdp2":
            # FSDP2 reduce-scatters each backward's gradients into the sharded ones, which
            # accumulate: no unsharded gradient is kept between micro-batches.
            backend.accelerator.backward(loss)
        else:
            with backend.accelerator.no_sync(model):
                backend.accelerator.backward(loss)
        return True

    def accumulating(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
        """Context around the forward AND backward of a micro-batch that is not the step's
        last (`micro_backward(..., last=False)`), for a forward that leaves parameters
        unused: under DDP (several ranks, no DeepSpeed) `no_sync`, so that the forward does
        not arm DDP's reducer for a gradient sync it would wait for in vain; the gradients
        accumulate locally and the step's last backward reduces them. Elsewhere nothing
        (DeepSpeed counts the gradients each backward produces)."""
        backend = self._backend
        if backend.engine == "ddp":
            return backend.accelerator.no_sync(model)
        return contextlib.nullcontext()

    def optimizer_step(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_norms: list[float]
    ) -> list[float] | None:
        """Clip, step and zero gradients; returns the pre-clip gradient norm of each param
        group, or None when the guard skipped the step (see Runtime.optimizer_step)."""
        self._steps_seen += 1
        if self._backend.zero_stage is not None:
            return self._deepspeed_step(model, optimizer, len(max_norms))
        torch_optimizer = stepping_optimizer(optimizer)
        norms = None
        if not self._poisoned:
            # Clipping computes each group's norm anyway: a non-finite norm is a non-finite
            # gradient, so the guard needs no extra pass over the gradients.
            groups = torch_optimizer.param_groups
            clip = _clip_sharded if self._backend.engine == "fsdp2" else _clip
            norms = [
                clip(group["params"], max_norm)
                for group, max_norm in zip(groups, max_norms, strict=True)
            ]
            bad = torch.tensor(0.0 if all(math.isfinite(n) for n in norms) else 1.0)
            if all_max(self._backend, bad) > 0:
                self._poisoned = True
        if self._poisoned:
            self._skip(model, optimizer)
            return None
        self.bad_steps_in_row = 0
        torch_optimizer.step()
        torch_optimizer.zero_grad(set_to_none=True)
        return norms

    def _deepspeed_step(
        self, model: DeepSpeedEngine, optimizer: torch.optim.Optimizer, groups: int
    ) -> list[float] | None:
        """DeepSpeed clips (one global norm) and steps inside engine.step()."""
        if self._poisoned:
            self._skip(model, optimizer)
            return None
        self.bad_steps_in_row = 0
        # DeepSpeed without ZeRO and without 16-bit clips fp32 gradients but keeps the norm
        # to itself (get_global_grad_norm() is None): measure it here, before the step.
        own_norm = _fp32_stage0_norm(model)
        if zero3.is_whole(model):
            zero3.release(model)  # what step() does first, without its per-weight cost
        model.step()  # clip + optimizer step + zero grad at the boundary we set
        norm = model.get_global_grad_norm()
        norm = float(norm) if norm is not None else own_norm
        if not math.isfinite(norm):
            raise TrainingDiverged(
                "DeepSpeed applied a step with a non-finite gradient norm after a finite loss; "
                "the weights are no longer trustworthy: resume from the last checkpoint"
            )
        return [norm] * groups

    def _skip(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self._discard_gradients(model, optimizer)
        self.skipped_steps += 1
        self.bad_steps_in_row += 1

    def _discard_gradients(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Drop the accumulated gradients of a skipped step (DeepSpeed: as its own fp16
        overflow handling does: zero_grad resets the micro-step so the next step's
        reduction overwrites the partitioned gradient buffers)."""
        self._poisoned = False
        if self._backend.zero_stage is not None:
            model.optimizer.zero_grad(set_to_none=True)
            if hasattr(model.optimizer, "averaged_gradients"):
                model.optimizer.averaged_gradients = {}
            if self._backend.zero_stage == 3:
                _release_zero3_params(model)
        else:
            optimizer.zero_grad(set_to_none=True)


def _release_zero3_params(engine: DeepSpeedEngine) -> None:
    """Wait for and re-partition every ZeRO-3 parameter a skipped step's forwards left
    gathered or in flight.

    With a complete trace, ZeRO-3's parameter coordinator prefetches (async all-gather,
    status INFLIGHT) the parameters of the modules that come next in the trace, and near
    the end of a forward those belong to the BACKWARD pass (PPO with a critic, 2 CPU
    ranks: the actor's embedding and first layer). Only that backward, or the next
    forward's start-of-forward reset_step, waits for them. A skipped
    step runs its forwards and no backward, so when the skipped step is the last of a PPO
    iteration the next thing to touch the engine is generation: DeepSpeed's
    unwrap_model_for_generation gathers only NOT_AVAILABLE parameters, runs the model with
    the in-flight ones still empty ("'weight' must be 2-D") and fails to re-partition them
    ("Cannot partition a param in flight"). Both ranks skip the same step and issued the
    same prefetches (same trace), so waiting here is collective-safe. The engine's
    empty_partition_cache (release_and_reset_all) waits for each in-flight all-gather and
    partitions every parameter, as a finished backward would have left them.
    """
    engine.empty_partition_cache()


def _clip(params: list[torch.Tensor], max_norm: float) -> float:
    return float(torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True))


def _clip_sharded(params: list[torch.Tensor], max_norm: float) -> float:
    return fsdp2.clip_grad_norm(params, max_norm)  # the norm over every rank's shards


def stepping_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside Accelerate's wrapper, when stepping it directly is the
    same: without an fp16 loss scaler (and without XLA) the wrapper's step only adds
    checks, two of them importlib look-ups on every call, a cost a tiny model's step
    notices. One level only: the checkpoint code's
    `innermost_optimizer` (training_state.py) goes through every level instead."""
    if getattr(optimizer, "scaler", None) is not None:
        return optimizer
    return getattr(optimizer, "optimizer", optimizer)


def _inject_nan(loss: torch.Tensor, step: int, rank: int) -> torch.Tensor:
    """Fault injection for the guard tests: RLHF_DIST_FAULT=nan:STEP[@RANK] makes the
    loss of optimizer step STEP (1-based, this process) NaN, on RANK only if given."""
    spec = os.environ.get("RLHF_DIST_FAULT", "")
    if not spec.startswith("nan:"):
        return loss
    steps, _, only_rank = spec[4:].partition("@")
    wanted = {int(x) for x in steps.split(",")}
    if step in wanted and (not only_rank or int(only_rank) == rank):
        return loss * float("nan")
    return loss


def _fp32_stage0_norm(engine: DeepSpeedEngine) -> float:
    """The global gradient norm of a DeepSpeed engine that will not report one (stage 0,
    fp32), else NaN (the engine reports its own). Grads are already reduced at the boundary."""
    if engine.zero_optimization_stage() != 0 or engine.bfloat16_enabled() or engine.fp16_enabled():
        return float("nan")
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads, foreach=True)) if grads else 0.0
