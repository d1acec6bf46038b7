"""Filling DeepSpeed's "auto" config entries from our run config (plain dict edits).

One place for each value: the batch sizes, clipping and precision come from our config;
an explicit DeepSpeed value that disagrees is a ConfigError rather than a silent override.
"""

from __future__ import annotations

import torch

from rlhf_dist.config import ConfigError


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


# DeepSpeed's own defaults, used as floors (elements): below them every bucket holds one
# small tensor and each collective pays its fixed latency for a few KiB.
MIN_BUCKET = 50_000_000
MIN_PERSISTENCE = 100_000


def fill_zero_buckets(ds: dict, model: torch.nn.Module) -> None:
    """Fill ZeRO bucket sizes left "auto" from the largest hidden size in `model` (the
    sizes Accelerate derives from `model.config`, which our composite modules lack), with
    DeepSpeed's defaults as floors.

    Accelerate's hidden^2 rule alone sized the gradient bucket of a hidden-64 model at 4096
    elements: every parameter got its own reduce-scatter (438 per optimizer step, 70% of a
    ZeRO-3 step on 2 CPU ranks). Tensors under the persistence threshold stay whole on
    every rank: gathering a few-KiB norm weight costs more than holding it.
    """
    hidden = max(
        (getattr(getattr(m, "config", None), "hidden_size", 0) or 0 for m in model.modules()),
        default=0,
    )
    if not hidden:
        return
    zero = ds.setdefault("zero_optimization", {})
    sizes = {
        "reduce_bucket_size": max(hidden * hidden, MIN_BUCKET),
        "stage3_prefetch_bucket_size": max(int(0.9 * hidden * hidden), MIN_BUCKET),
        "stage3_param_persistence_threshold": max(10 * hidden, MIN_PERSISTENCE),
    }
    for key, value in sizes.items():
        if zero.get(key) == "auto":
            zero[key] = value


def _fill_auto(section: dict, key: str, value, name: str) -> None:
    current = section.get(key, "auto")
    if current == "auto":
        section[key] = value
    elif current != value:
        raise ConfigError(
            f'DeepSpeed config {name}={current!r} disagrees with the run config ({value!r}); set it to "auto"'
        )
