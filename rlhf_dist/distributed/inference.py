"""Where weights are whole: frozen models, generation, training steps, loading outside ZeRO-3.

Frozen models (reference, reward model) are replicated or partitioned like the trainable
ones; generation gets the unwrapped module with, under ZeRO-3, its parameters gathered
once; training steps gather the trained model whole when a copy fits (zero3.py);
`local_loading` keeps a one-rank model load out of ZeRO-3's collective init.
"""

from __future__ import annotations

import contextlib
import functools
import os
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from rlhf_dist.distributed import fsdp2, zero3
from rlhf_dist.distributed.backend import Backend
from rlhf_dist.distributed.collectives import all_max, any_rank
from rlhf_dist.distributed.zero3 import whole_bytes
from rlhf_dist.errors import ConfigError


def prepare_frozen(
    backend: Backend,
    model: torch.nn.Module,
    placement: str = "auto",
    dtype: str = "float32",
    name: str = "frozen model",
) -> torch.nn.Module:
    """A frozen inference-only model (reference, reward model) for this backend.

    placement "auto": a full copy on every rank when it fits (`replicate_fits`), else,
    under ZeRO-3, partitioned (a DeepSpeed inference engine: each rank holds 1/world of
    the weights and gathers every layer on every forward). "offload" keeps the partitions
    in CPU memory. Returns a callable module.
    """
    model.requires_grad_(False)
    model.eval()
    if placement == "auto":
        replicate = backend.zero_stage != 3 or replicate_fits(backend, model)
        placement = "replicate" if replicate else "partition"
        if backend.zero_stage == 3 and backend.is_main:
            gib = _bytes(model) / 2**30
            print(
                f"distributed.frozen_models=auto: {name} {placement}d ({gib:.2f} GiB)", flush=True
            )
    if placement == "replicate":
        return model.to(backend.device)
    if backend.zero_stage is None:
        raise ConfigError(
            f"distributed.frozen_models: {placement!r} needs a DeepSpeed launch (accelerate config with DeepSpeed)"
        )
    import deepspeed

    zero: dict[str, Any] = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if placement == "offload":
        zero["offload_param"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == "bfloat16"},
    }
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine


# A replicated frozen model may take this share of the memory free when it is placed: the
# trained models' states, activations and the KV cache need the rest.
REPLICATE_SHARE = 0.25


def replicate_fits(backend: Backend, model: torch.nn.Module) -> bool:
    """Whether a full copy of `model` fits on every rank (REPLICATE_SHARE of its free
    memory). Partitioned, a frozen model is gathered layer by layer on every forward of
    every rollout micro-batch: scoring costs several times the replicated time. All
    ranks agree (a partitioned engine needs every rank)."""
    return copy_fits(backend, _bytes(model))


def copy_fits(backend: Backend, nbytes: int) -> bool:
    """Whether `nbytes` fit in REPLICATE_SHARE of the free memory of EVERY rank (a
    collective; all ranks get the same answer)."""
    fits = nbytes <= REPLICATE_SHARE * _free_bytes(backend)
    return not all_max(backend, torch.tensor(0.0 if fits else 1.0)) > 0


def _bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _free_bytes(backend: Backend) -> int:
    """Free accelerator memory of this rank, or this rank's share of free host memory."""
    if backend.device.type == "cuda":
        return torch.cuda.mem_get_info(backend.device)[0]
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // local


@contextlib.contextmanager
def generation_context(
    backend: Backend, model: torch.nn.Module, submodule: str | None = None, gather: bool = True
) -> Iterator[tuple[torch.nn.Module, Callable[[bool], bool] | None]]:
    """Yield (module, keep_in_step) for `engine.decode.generate`: `module` is the unwrapped
    model (or its `submodule`); keep_in_step is None, or (ranks in lock-step) a
    function from "this rank needs another forward" to "some rank does".

    Under ZeRO-3 the parameters are gathered ONCE for the whole rollout and the
    per-module gather hooks removed (re-added on exit); under FSDP2 every unit is
    all-gathered once and kept whole (fsdp2.whole_weights): generation then runs no
    collective at all, so ranks that finish at different lengths cannot hang each
    other and no per-token all-reduce is needed. With gather=False (models larger
    than one device) generation goes through ZeRO-3's per-layer gathers and every
    rank keeps stepping until all are done (one all-reduce of a flag per token).
    """
    inner = backend.unwrap(model)
    target = getattr(inner, submodule) if submodule else inner
    if backend.engine == "fsdp2" and gather:
        with fsdp2.whole_weights(model):
            yield target, None
    elif backend.engine == "fsdp2":
        with fsdp2.root_whole(model):
            yield target, functools.partial(any_rank, backend)
    elif backend.zero_stage != 3:
        yield target, None
    elif not gather:
        yield target, (functools.partial(any_rank, backend) if backend.world_size > 1 else None)
    else:
        with zero3.whole_weights(model):
            yield target, None


def whole_weights_under_zero3(
    backend: Backend, model: torch.nn.Module, enabled: bool = True
) -> contextlib.AbstractContextManager[None]:
    """Context: under ZeRO-3 or FSDP2 (and `enabled`), every weight of trained `model`
    whole on every rank for the body (ZeRO-3: one collective, its per-module hooks off,
    zero3.whole_weights; FSDP2: each unit gathered once, fsdp2.whole_weights); otherwise
    a no-op. Every rank enters together."""
    if not enabled:
        return contextlib.nullcontext()
    if backend.engine == "fsdp2":
        return fsdp2.whole_weights(model)
    if backend.zero_stage != 3:
        return contextlib.nullcontext()
    return zero3.whole_weights(model)


# Engine -> whether its training steps gather it whole (decided once per engine).
_TRAINING_GATHER: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


def training_weights(
    backend: Backend, model: torch.nn.Module, setting: str = "auto", name: str = "model"
) -> contextlib.AbstractContextManager[None]:
    """Context for `model`'s training steps (forwards, backwards, optimizer steps), per
    perf.gather_for_training: under ZeRO-3, "always" gathers its weights whole
    once per optimizer step (zero3.py), "never" keeps ZeRO-3's per-layer fetching, and
    "auto" gathers when one full copy takes at most REPLICATE_SHARE of every rank's free
    memory (decided once per model, printed). A no-op without ZeRO-3."""
    if backend.zero_stage != 3:
        return contextlib.nullcontext()
    if model not in _TRAINING_GATHER:
        nbytes = whole_bytes(model)
        whole = setting == "always" or (setting == "auto" and copy_fits(backend, nbytes))
        _TRAINING_GATHER[model] = whole
        if setting == "auto" and backend.is_main:
            how = "gathered whole per optimizer step" if whole else "fetched layer by layer"
            gib = nbytes / 2**30
            print(f"perf.gather_for_training=auto: {name} {how} ({gib:.2f} GiB)", flush=True)
    return whole_weights_under_zero3(backend, model, _TRAINING_GATHER[model])


@contextlib.contextmanager
def local_loading() -> Iterator[None]:
    """Load models whole in this process, even after ZeRO-3 engines exist.

    Once DeepSpeed ZeRO-3 is initialised, transformers' from_pretrained builds models
    under zero.Init, which partitions them with collectives that every rank must join;
    a model loaded on one rank only (an export) would hang the others.
    """
    import transformers.integrations.deepspeed as hf_ds

    saved = hf_ds._hf_deepspeed_config_weak_ref
    hf_ds.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = saved
