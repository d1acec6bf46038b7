"""FSDP2 (`torch.distributed.fsdp.fully_shard`) as the second sharded engine, chosen by the
Accelerate config (`distributed_type: FSDP`, `fsdp_version: 2`); docs/distributed.md
"Choosing the engine".

Accelerate 1.15 applies FSDP only to GPU-like devices (on CPU ranks it falls back to DDP
without a word), so the sharding is done here, the same way on CPU (gloo) and GPU: each
decoder layer (the classes transformers never splits, `_no_split_modules`) is one FSDP
unit, the rest of the model the root unit. Parameters become DTensors sharded on dim 0
over all ranks (`Shard(0)`); a unit's weights are all-gathered for its forward and
backward and freed after (`reshard_after_forward`), and each backward reduce-scatters
the unit's gradients, averaged over ranks as DDP and ZeRO do (docs/architecture.md
section 4: losses are scaled by the world size for that).

Mixed precision as under ZeRO-3's bf16: fp32 master weights (the sharded parameters, which
the optimizer steps), bf16 copies for the forward and backward, gradients reduced in
fp32 (`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator

import torch

from rlhf_dist.errors import ConfigError


def fsdp_launch() -> bool:
    """Whether `accelerate launch` started this process with an FSDP config."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def _flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() == "true"


def offloads_params() -> bool:
    """fsdp_offload_params: the shards (weights, gradients, optimizer states) live in CPU
    memory (CPUOffloadPolicy); the memory planner counts them there."""
    return _flag("FSDP_OFFLOAD_PARAMS")


def check_fsdp_config() -> None:
    """Refuse, in one line naming the accelerate config key, what this engine does not do."""
    version = os.environ.get("FSDP_VERSION", "1")
    if version != "2":
        raise ConfigError(
            f"fsdp_version: {version} (accelerate config): only FSDP2 is supported; set fsdp_version: 2"
        )
    if _flag("FSDP_CPU_RAM_EFFICIENT_LOADING"):
        # transformers then loads real weights on rank 0 only (the others get zeros) and
        # leaves the broadcast to the sharding, which here cuts every rank's own copy.
        raise ConfigError(
            "fsdp_cpu_ram_efficient_loading (accelerate config; true unless set): "
            "set it to false, every rank loads the weights before they are sharded"
        )
    if _flag("FSDP_ACTIVATION_CHECKPOINTING"):
        raise ConfigError(
            "fsdp_activation_checkpointing (accelerate config): use the run config's "
            "model.gradient_checkpointing=true instead (one switch for every engine)"
        )
    if offloads_params() and not torch.cuda.is_available():
        # CPUOffloadPolicy pins host memory for copies to an accelerator: with none, torch
        # stops in every rank's first forward ("Cannot access accelerator device").
        raise ConfigError(
            "fsdp_offload_params (accelerate config): offloads a GPU's shards to CPU memory, "
            "and these ranks run on the CPU already; set it to false"
        )


def layer_classes(model: torch.nn.Module) -> set[type]:
    """The decoder-layer classes in `model`: what transformers never splits."""
    names = {n for m in model.modules() for n in (getattr(m, "_no_split_modules", None) or ())}
    return {type(m) for m in model.modules() if type(m).__name__ in names}


def shard_model(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, dtype: str
) -> torch.nn.Module:
    """Shard `model` in place over all ranks (one FSDP unit per decoder layer, the root
    for the rest) and point `optimizer` at the sharded parameters; returns the model.

    bf16 runs keep fp32 masters: the weights are made fp32 here (the optimizer steps them)
    and FSDP2 casts the gathered copies to bf16 for compute. Parameters are matched to
    the optimizer's by name (fully_shard replaces every nn.Parameter by a DTensor one).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if any(type(p).__name__ == "Params4bit" for p in model.parameters()):
        raise ConfigError(
            "lora.load_in_4bit: QLoRA's bitsandbytes 4-bit weights cannot be sharded by "
            "FSDP2 here; use a DeepSpeed or single-GPU accelerate config"
        )
    names = {id(p): n for n, p in model.named_parameters()}
    if dtype == "bfloat16":
        model.float()  # identity of the Parameters is kept: .float() swaps .data
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        policy = MixedPrecisionPolicy()
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    options: dict = {
        "mesh": mesh,
        "mp_policy": policy,
        "reshard_after_forward": os.environ.get("FSDP_RESHARD_AFTER_FORWARD", "true") == "true",
    }
    if offloads_params():
        options["offload_policy"] = CPUOffloadPolicy()
    classes = tuple(layer_classes(model))
    for module in [m for m in model.modules() if classes and isinstance(m, classes)]:
        fully_shard(module, **options)
    # The root unit (embeddings, final norm, output head) stays whole from its forward to
    # its backward: the chunked log-prob head reads the head's weight directly after the
    # model's forward (engine/forward.py head_logprobs), outside any unit's hooks.
    fully_shard(model, **(options | {"reshard_after_forward": False}))
    # Make `model` the root now: the first forward may be a submodule's (an ActorCritic's
    # actor generating), which would otherwise make that unit a root of its own.
    model._get_fsdp_state()._lazy_init()
    sharded = dict(model.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [sharded[names[id(p)]] for p in group["params"]]
    return model


def is_sharded(p: torch.Tensor) -> bool:
    """Whether `p` is an FSDP2 (DTensor) parameter."""
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor)


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float) -> float:
    """Clip the gradients of sharded `params` to a global norm of `max_norm`; returns the
    pre-clip norm over all ranks' shards (the same on every rank; a collective)."""
    from torch.distributed.tensor import DTensor

    with_grads = [p for p in params if p.grad is not None]  # every rank: the same params
    grads = [p.grad for p in with_grads if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(with_grads, max_norm, norm, foreach=True)
    return float(norm)


def _units(model: torch.nn.Module) -> list[torch.nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


_WHOLE: set[int] = set()  # ids of the models inside whole_weights now


@contextlib.contextmanager
def whole_weights(model: torch.nn.Module) -> Iterator[None]:
    """Context: every unit of sharded `model` all-gathered once, kept whole through any
    number of forwards (the decode loop: no collective per token, so ranks that stop at
    different lengths cannot hang each other), resharded on exit. Every rank enters."""
    if id(model) in _WHOLE:  # nested (a rollout's generation inside its scoring context)
        yield
        return
    units = _units(model)
    _WHOLE.add(id(model))
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        _WHOLE.discard(id(model))
        reshard = os.environ.get("FSDP_RESHARD_AFTER_FORWARD", "true") == "true"
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(reshard, recurse=False)


@contextlib.contextmanager
def root_whole(model: torch.nn.Module) -> Iterator[None]:
    """Context: only the root unit of sharded `model` (embeddings, final norm, heads)
    gathered, the decoder layers still gathered by their own units in each forward: a
    submodule called directly (an ActorCritic's actor generating) runs outside the root's
    hooks. Every rank enters; each layer's forward is then a collective (keep ranks in
    step). A no-op inside whole_weights."""
    if id(model) in _WHOLE:
        yield
        return
    model.unshard()
    try:
        yield
    finally:
        model.reshard()


def full_state_dict(model: torch.nn.Module, is_main: bool) -> dict | None:
    """The whole state dict of sharded `model` on the main process, on CPU (a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    return state if is_main else None


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded (DTensor) `t`, gathered on every rank; `t` otherwise."""
    return t.full_tensor() if is_sharded(t) else t


def set_from_full(t: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's shard of `full` (t's whole shape) into sharded `t`, in place."""
    from torch.distributed.tensor import distribute_tensor

    # src_data_rank=None: each rank cuts its own shard from its copy, no collective.
    shard = distribute_tensor(
        full.to(t.device, t.dtype),
        t.device_mesh,
        t.placements,
        src_data_rank=None,
    )
    with torch.no_grad():
        t.to_local().copy_(shard.to_local())
