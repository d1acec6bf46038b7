"""Pieces every trainer shares: run directory, optimizer and schedule, final export."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from rlhf_dist.config import Config, save_config, to_dict
from rlhf_dist.tracking import MetricsLogger


def start_run(cfg: Config, runtime, stage: str) -> tuple[Path, MetricsLogger]:
    """Create the output directory, write config.yaml and open the metrics sink."""
    out = Path(cfg.run.output_dir)
    if runtime.is_main:
        save_config(cfg, out)
    runtime.barrier()
    return out, MetricsLogger(runtime, out, cfg.run, to_dict(cfg), stage)


def make_optimizer(groups) -> torch.optim.Optimizer:
    """AdamW with one param group per (parameters, OptimConfig) pair, each its own lr/eps."""
    param_groups = [
        {
            "params": [p for p in params if p.requires_grad],
            "lr": optim.lr,
            "weight_decay": optim.weight_decay,
            "eps": optim.adam_eps,
        }
        for params, optim in groups
    ]
    return torch.optim.AdamW(param_groups, betas=(0.9, 0.999))


def make_scheduler(optimizer, optim_cfgs, total_steps: int):
    """LambdaLR per param group: linear warmup, then constant, linear or cosine decay to 0."""

    def factor(cfg):
        def f(step: int) -> float:
            if step < cfg.warmup_steps:
                return (step + 1) / cfg.warmup_steps
            progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
            if cfg.schedule == "linear":
                return 1.0 - progress
            if cfg.schedule == "cosine":
                return 0.5 * (1.0 + math.cos(math.pi * progress))
            return 1.0

        return f

    return torch.optim.lr_scheduler.LambdaLR(optimizer, [factor(c) for c in optim_cfgs])


def save_pretrained(runtime, model, tokenizer, directory: Path, submodule: str = "") -> None:
    """Write an HF-format model + tokenizer (safetensors) that from_pretrained loads.

    model: the prepared model; submodule: dotted path inside it of the transformers model
    to save (e.g. "actor", "critic.classifier"). Under ZeRO-3 the full 16-bit weights are
    gathered first (every rank must call this).
    """
    state = runtime.full_state_dict(model)
    if runtime.is_main:
        target, prefix = runtime.unwrap(model), ""
        for name in filter(None, submodule.split(".")):
            target, prefix = getattr(target, name), prefix + name + "."
        own = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        directory.mkdir(parents=True, exist_ok=True)
        target.save_pretrained(directory, state_dict=own, safe_serialization=True)
        tokenizer.save_pretrained(directory)
    runtime.barrier()


def write_summary(runtime, out: Path, summary: dict) -> None:
    if runtime.is_main:
        tmp = out / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, out / "summary.json")
