"""Models used for inference only: frozen models, generation, loading outside ZeRO-3.

Frozen models (reference, reward model) are replicated or partitioned like the trainable
ones; generation gets the unwrapped module with, under ZeRO-3, its parameters gathered
once; `local_loading` keeps a one-rank model load out of ZeRO-3's collective init.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch

from rlhf_dist.config import ConfigError
from rlhf_dist.distributed.backend import Backend
from rlhf_dist.distributed.collectives import all_max, any_rank


def prepare_frozen(
    backend: Backend,
    model: torch.nn.Module,
    placement: str = "auto",
    dtype: str = "float32",
    name: str = "frozen model",
):
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

    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
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
    every rollout micro-batch: scoring cost 5-15x the replicated time under ZeRO-3. All
    ranks agree (a partitioned engine needs every rank)."""
    fits = _bytes(model) <= REPLICATE_SHARE * _free_bytes(backend)
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
    backend: Backend, model, submodule: str | None = None, gather: bool = True
) -> Iterator:
    """Yield (module, keep_in_step) for `rollout.generate`: `module` is the unwrapped
    model (or its `submodule`); keep_in_step is None, or (ranks in lock-step) a
    function from "this rank needs another forward" to "some rank does".

    Under ZeRO-3 the parameters are gathered ONCE for the whole rollout and the
    per-module gather hooks removed (re-added on exit): generation then runs no
    collective at all, so ranks that finish at different lengths cannot hang each
    other and no per-token all-reduce is needed. With gather=False (models larger
    than one device) generation goes through ZeRO-3's per-layer gathers and every
    rank keeps stepping until all are done (one all-reduce of a flag per token).
    """
    inner = backend.unwrap(model)
    target = getattr(inner, submodule) if submodule else inner
    if backend.zero_stage != 3:
        yield target, None
    elif not gather:
        yield target, (functools.partial(any_rank, backend) if backend.world_size > 1 else None)
    else:
        from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

        with unwrap_model_for_generation(model):
            yield target, None


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
