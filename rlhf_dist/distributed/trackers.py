"""Experiment trackers (W&B, TensorBoard, trackio) through Accelerate's tracking API
(Accelerate builds each from its name: `Backend(trackers=...)`)."""

from __future__ import annotations

from typing import Any

from rlhf_dist.distributed.backend import Backend


def start_trackers(backend: Backend, project: str, config: dict, init_kwargs: dict) -> None:
    """Start the trackers the Backend was built with (main process only)."""
    backend.accelerator.init_trackers(project, config=config, init_kwargs=init_kwargs)


def log_scalars(backend: Backend, values: dict, step: int) -> None:
    backend.accelerator.log(values, step=step)


def tracker(backend: Backend, name: str) -> Any:
    """The underlying tracker object (wandb run, TensorBoard SummaryWriter, trackio Run)."""
    return backend.accelerator.get_tracker(name, unwrap=True)


def finish_trackers(backend: Backend) -> None:
    """Finish the trackers but keep the process group (Accelerate's end_training would
    destroy it, and later stages or collectives of this process still need it)."""
    for each in backend.accelerator.trackers:
        each.finish()
    backend.accelerator.trackers = []
