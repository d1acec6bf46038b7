"""Filling DeepSpeed's "auto" config entries from our run config (plain dict edits).

One place for each value: the batch sizes, clipping and precision come from our config;
an explicit DeepSpeed value that disagrees is a ConfigError rather than a silent override.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

import torch

from rlhf_dist.config import sizes
from rlhf_dist.errors import ConfigError


def fill_deepspeed_config(
    ds: dict, micro: int, accumulation: int, world_size: int, max_grad_norm: float, dtype: str
) -> None:
    """Fill (in place) the batch, clipping and bf16 entries of DeepSpeed config `ds`."""
    wanted = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": micro * accumulation * world_size,
        "gradient_clipping": max_grad_norm,
    }
    for key, value in wanted.items():
        _fill_auto(ds, key, value, key)
    bf16 = ds.setdefault("bf16", {})
    _fill_auto(bf16, "enabled", dtype == "bfloat16", "bf16.enabled")


MIN_BUCKET = sizes.MIN_BUCKET  # re-exported: the floor's rule lives in config/sizes.py


def fill_zero_buckets(ds: dict, model: torch.nn.Module) -> None:
    """Fill ZeRO bucket sizes left "auto" from the largest hidden size in `model` (the
    sizes Accelerate derives from `model.config`, which our composite modules lack), with
    DeepSpeed's default (or an eighth of the trained parameters, if smaller) as the floor
    of the bucket sizes.

    Accelerate's hidden^2 rule alone sizes the gradient bucket of a hidden-64 model at 4096
    elements: every parameter gets its own reduce-scatter, hundreds per optimizer step.
    No tensor is persistent (threshold 0): with whole decoder layers fetched at once
    (backend.fetch_whole_layers) small tensors ride along with their layer's gather, while
    every persistent tensor (with a threshold of 10 x hidden, the norm weights; with
    DeepSpeed's 1e5, all of a small model) costs an all-gather of its own after each
    optimizer step.
    """
    hidden = max(
        (getattr(getattr(m, "config", None), "hidden_size", 0) or 0 for m in model.modules()),
        default=0,
    )
    if not hidden:
        return
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    zero = ds.setdefault("zero_optimization", {})
    filled = {
        "reduce_bucket_size": sizes.zero_reduce_bucket(hidden, params),
        "stage3_prefetch_bucket_size": sizes.zero_prefetch_bucket(hidden, params),
        "stage3_param_persistence_threshold": 0,
    }
    for key, value in filled.items():
        if zero.get(key) == "auto":
            zero[key] = value


def fill_gloo_zero3(ds: dict) -> None:
    """ZeRO-3 over gloo (CPU ranks): fetch weights with an all-reduce of a zero-filled
    buffer into which each rank writes its own partitions
    (`stage3_use_all_reduce_for_fetch_params`), unless the DeepSpeed config says otherwise.

    The all-gather path copies every weight out of the gathered buffer one by one (its
    partitions lie rank after rank); with the all-reduce every weight is a view of the
    summed buffer already. On gloo an all-reduce costs about what its all-gather does, so
    the copies are saved; on NCCL an all-reduce moves twice an all-gather's bytes, so GPU
    runs keep the all-gather.
    """
    ds.setdefault("zero_optimization", {}).setdefault(
        "stage3_use_all_reduce_for_fetch_params", True
    )


# The checkout that ships ds_configs/ next to the package: the accelerate configs of
# accelerate_configs/ name their DeepSpeed file relative to it.
SHIPPED_ROOT = Path(__file__).resolve().parents[2]
DS_FILE_VARIABLE = "ACCELERATE_DEEPSPEED_CONFIG_FILE"  # what `accelerate launch` passes on


def resolve_deepspeed_file(environ: MutableMapping[str, str] = os.environ) -> None:
    """Make the accelerate config's `deepspeed_config_file` an absolute path (in place, in
    `environ`) before Accelerate reads it, so a launch works from any working directory.

    A relative name is looked up in the working directory first (what Accelerate itself
    does), then under the checkout the shipped configs name their files from
    (`SHIPPED_ROOT`: `ds_configs/zero3.json`). A `.json` name found in neither is a
    ConfigError naming the key; anything else (unset, a base64-encoded config) is left to
    Accelerate.
    """
    name = environ.get(DS_FILE_VARIABLE, "none")
    if name == "none" or not name.endswith(".json"):
        return
    for base in (Path.cwd(), SHIPPED_ROOT):
        found = base / name  # an absolute name stays itself
        if found.is_file():
            environ[DS_FILE_VARIABLE] = str(found.resolve())
            return
    raise ConfigError(
        f"deepspeed_config_file {name!r} (accelerate config): no such file in "
        f"{Path.cwd()} or {SHIPPED_ROOT}; give its absolute path"
    )


def _fill_auto(section: dict, key: str, value: object, name: str) -> None:
    """Set `section[key]` to our `value` where it is absent or "auto"; a DeepSpeed value
    that disagrees is a ConfigError naming the entry (`name`)."""
    current = section.get(key, "auto")
    if current == "auto":
        section[key] = value
    elif current != value:
        raise ConfigError(
            f'DeepSpeed config {name}={current!r} disagrees with the run config ({value!r}); set it to "auto"'
        )
