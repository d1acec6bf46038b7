"""Full model state gathered from the backends, and world-size independent checkpoints.

Under ZeRO the weights, gradients, fp32 masters and Adam moments are partitioned over
ranks; these functions gather them (every rank must call) or scatter them back, so a
checkpoint written on N ranks resumes on M.

Under FSDP2 nothing is gathered: torch.distributed.checkpoint (DCP) writes each rank's
shards of the same entries (`params/NAME`, `exp_avg/NAME`, `exp_avg_sq/NAME`, `step`) and
reads back into this run's shards whatever the world size that wrote them; any other
engine (one process, ZeRO) reads such a checkpoint whole (`read_full_state`).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from rlhf_dist.distributed import fsdp2
from rlhf_dist.distributed.backend import Backend
from rlhf_dist.errors import ConfigError

MOMENTS = ("exp_avg", "exp_avg_sq")


def full_state_dict(backend: Backend, model: torch.nn.Module) -> dict | None:
    """The full (gathered, under ZeRO-3 16-bit) state dict on the main process."""
    if backend.engine == "fsdp2":
        return fsdp2.full_state_dict(model, backend.is_main)
    state = backend.accelerator.get_state_dict(model)
    return state if backend.is_main else None


def gather_training_state(
    backend: Backend, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict | None:
    """World-size independent training state, on the main process (None elsewhere).

    {"params": {name: fp32}, "exp_avg": {...}, "exp_avg_sq": {...}, "step": int} for
    every trainable parameter, whatever the backend: under ZeRO the fp32 master
    partitions and Adam moments are gathered (every rank must call). A checkpoint in
    this form resumes on any number of ranks (verl #2265, OpenRLHF #1067 could not).
    """
    named = [(n, p) for n, p in backend.unwrap(model).named_parameters() if p.requires_grad]
    inner = innermost_optimizer(optimizer)
    state: dict[str, Any] = {
        "params": {},
        "exp_avg": {},
        "exp_avg_sq": {},
        "step": _adam_step(inner),
    }
    for name, p in named:
        full = _full_zero_state(p) or _full_fsdp2_state(p, inner)
        if full is None:  # not partitioned: the module and the torch optimizer hold it
            full = {"params": p.detach()} | {
                k: v for k, v in inner.state.get(p, {}).items() if k in ("exp_avg", "exp_avg_sq")
            }
        for key, value in full.items():
            if value is not None and backend.is_main:
                state[key][name] = value.detach().float().cpu().clone()
    return state if backend.is_main else None


def restore_optimizer_state(
    backend: Backend, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict
) -> None:
    """Put `state` (from gather_training_state) into a prepared model's optimizer.

    The weights themselves must already be in the module before `prepare` (so every
    backend partitions the right values); this sets the fp32 masters and Adam moments.
    """
    inner = innermost_optimizer(optimizer)
    if state["step"] > 0:
        _materialise_adam_state(inner, _zero_flat_partitions(optimizer))
    for name, p in backend.unwrap(model).named_parameters():
        if not p.requires_grad or name not in state["params"]:
            continue
        if _is_zero_partitioned(p):
            _scatter_zero_state(backend, p, name, state)
        elif fsdp2.is_sharded(p):
            _scatter_fsdp2_state(inner, p, name, state)
        elif name in state["exp_avg"]:
            inner.state[p] = {
                # on the parameter's device: fused Adam requires it
                "step": torch.tensor(float(state["step"]), device=p.device),
                "exp_avg": state["exp_avg"][name].to(p.device, p.dtype).clone(),
                "exp_avg_sq": state["exp_avg_sq"][name].to(p.device, p.dtype).clone(),
            }
    for param_state in inner.state.values():  # ZeRO's flat partitions: one shared count
        if isinstance(param_state.get("step"), torch.Tensor):
            param_state["step"] = torch.full_like(param_state["step"], float(state["step"]))


def innermost_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside Accelerate's and DeepSpeed's wrappers (every level: under
    ZeRO, Accelerate's wrapper holds DeepSpeed's ZeRO optimizer, which holds the AdamW
    whose state the checkpoint reads and writes). guard.stepping_optimizer, for the step,
    goes one level down only."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def _scatter_zero_state(backend: Backend, p: torch.nn.Parameter, name: str, state: dict) -> None:
    """Set this rank's partition of a ZeRO-managed parameter's fp32 master and moments
    from the full tensors in `state` (each of p's full shape)."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    safe_set_full_fp32_param(p, state["params"][name].to(backend.device))
    for key in ("exp_avg", "exp_avg_sq"):
        if name in state[key]:
            safe_set_full_optimizer_state(p, state[key][name].to(backend.device), key)


def _zero_flat_partitions(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """ZeRO-3's flat fp32 partitions (its torch optimizer sees them only during a step)."""
    while optimizer is not None:
        flat = getattr(optimizer, "fp32_partitioned_groups_flat", None)
        if flat is not None:
            return list(flat)
        optimizer = getattr(optimizer, "optimizer", None)
    return []


def _materialise_adam_state(
    inner: torch.optim.Optimizer, extra_params: Iterable[torch.Tensor] = ()
) -> None:
    """Create zero Adam moments for every parameter (torch and ZeRO create them lazily at
    the first step), so that saved moments have somewhere to go before that step."""
    params = [p for group in inner.param_groups for p in group["params"]] + list(extra_params)
    for p in params:
        if not inner.state.get(p):
            inner.state[p] = {
                "step": torch.tensor(0.0, device=p.device),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }


def _adam_step(inner: torch.optim.Optimizer) -> int:
    """Adam's step count of `inner` (the largest of its parameters'; 0 before a step)."""
    steps = [int(s["step"]) for s in inner.state.values() if "step" in s]
    return max(steps, default=0)


def _is_zero_partitioned(p: torch.nn.Parameter) -> bool:
    """Whether ZeRO manages `p` (stage 3: ds_id; stages 1-2: a high-precision mapping)."""
    return hasattr(p, "ds_id") or hasattr(p, "_hp_mapping")


def _full_zero_state(p: torch.nn.Parameter) -> dict | None:
    """Gathered fp32 weight and Adam moments of a ZeRO-managed parameter (collective)."""
    if not _is_zero_partitioned(p):
        return None
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    return {
        "params": safe_get_full_fp32_param(p),
        "exp_avg": safe_get_full_optimizer_state(p, "exp_avg"),
        "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq"),
    }


def _full_fsdp2_state(p: torch.nn.Parameter, inner: torch.optim.Optimizer) -> dict | None:
    """Whole fp32 weight and Adam moments of an FSDP2 (DTensor) parameter: its shards and
    its moments' shards gathered (a collective)."""
    if not fsdp2.is_sharded(p):
        return None
    moments = {k: v for k, v in inner.state.get(p, {}).items() if k in ("exp_avg", "exp_avg_sq")}
    return {"params": fsdp2.full_tensor(p.detach())} | {
        k: fsdp2.full_tensor(v) for k, v in moments.items()
    }


def _scatter_fsdp2_state(
    inner: torch.optim.Optimizer, p: torch.nn.Parameter, name: str, state: dict
) -> None:
    """Set this rank's shard of an FSDP2 parameter's fp32 weight and Adam moments from
    the whole tensors in `state` (every rank cuts its own shard, no collective)."""
    fsdp2.set_from_full(p, state["params"][name])
    if name in state["exp_avg"]:
        moments = inner.state.setdefault(p, {})
        moments["step"] = torch.tensor(float(state["step"]))
        for key in ("exp_avg", "exp_avg_sq"):
            moments[key] = torch.zeros_like(p)
            fsdp2.set_from_full(moments[key], state[key][name])


def writes_shards(backend: Backend) -> bool:
    """Whether this run's checkpoints are sharded (DCP): under FSDP2."""
    return backend.engine == "fsdp2"


def save_sharded_state(
    backend: Backend, model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path
) -> None:
    """Write the FSDP2 training state under `directory` with DCP: every rank writes its
    own shards of each trainable weight and Adam moment (files fsynced), nothing is
    gathered; the step count once (a collective)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_sharded_entries(backend, model, optimizer), checkpoint_id=directory)


def load_sharded_state(
    backend: Backend, model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path
) -> None:
    """Read a DCP checkpoint into a prepared FSDP2 model's shards and its optimizer's
    moments, in place (a collective). DCP reshards on load: each rank reads the parts of
    the saved shards that overlap its own, whatever the world size that wrote them."""
    import torch.distributed.checkpoint as dcp

    saved = _saved_entries(directory)
    unknown = {k.split("/", 1)[1] for k in saved if k.startswith("params/")}
    unknown -= {n for n, p in backend.unwrap(model).named_parameters() if p.requires_grad}
    if unknown:
        raise ConfigError(
            f"run.resume: checkpoint has weights the model lacks, e.g. {sorted(unknown)[0]!r}"
        )
    inner = innermost_optimizer(optimizer)
    if any(k.startswith("exp_avg/") for k in saved):
        _materialise_adam_state(inner)
    entries = _sharded_entries(backend, model, optimizer)
    entries = {k: v for k, v in entries.items() if k in saved}
    with torch.no_grad():  # in place into the parameters' local shards
        dcp.load(entries, checkpoint_id=directory)
    step = float(entries["step"])
    for param_state in inner.state.values():
        param_state["step"] = torch.tensor(step)


def read_full_state(directory: Path) -> dict:
    """A DCP checkpoint read whole by this process alone (no collective): the dict
    gather_training_state returns, for an engine that does not shard the FSDP2 way."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    target = {
        key: torch.empty(tuple(m.size), dtype=m.properties.dtype)
        for key, m in _saved_entries(directory).items()
        if isinstance(m, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # "assuming ... a single process": that is the intent
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(target, checkpoint_id=directory, no_dist=True)
    state: dict[str, Any] = {"params": {}, "exp_avg": {}, "exp_avg_sq": {}}
    state["step"] = int(target.pop("step"))
    for key, value in target.items():
        group, name = key.split("/", 1)
        state[group][name] = value
    return state


def _saved_entries(directory: Path) -> dict[str, Any]:
    """The entries of DCP checkpoint `directory`: key -> its storage metadata."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(directory).read_metadata()
    return dict(metadata.state_dict_metadata)


def _sharded_entries(
    backend: Backend, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, torch.Tensor]:
    """The DCP entries of an FSDP2 model and its optimizer: each trainable parameter
    (a DTensor: this rank's shard of its whole shape) and its Adam moments where they
    exist, by the names of the consolidated checkpoint; the step count as a 0-d tensor."""
    inner = innermost_optimizer(optimizer)
    entries = {"step": torch.tensor(_adam_step(inner))}
    for name, p in backend.unwrap(model).named_parameters():
        if not p.requires_grad:
            continue
        entries[f"params/{name}"] = p.detach()  # shares the parameter's storage
        moments = inner.state.get(p, {})
        entries |= {f"{k}/{name}": moments[k] for k in MOMENTS if k in moments}
    return entries
