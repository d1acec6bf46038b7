"""Atomic, resumable checkpoints that do not depend on the number of ranks.

Layout under <output_dir>/checkpoints/:

    step-000012/
      training.pt        fp32 weights + Adam moments + step of every trainable parameter
      training/          the same under FSDP2, as torch.distributed.checkpoint shards
                         (each rank writes its own; read back at any world size)
      trainer.pt         loop position, scheduler, KL controller, ... (plain data)
      rng-rank00000.pt   each rank's RNG states (python, numpy, torch)
      meta.json          world size, format version, step
    latest               text: the name of the newest complete checkpoint

A checkpoint is written into a `.tmp-*` directory, every file fsynced, then renamed into
place; `latest` moves only after that. A process killed at any moment leaves either the
previous complete checkpoint or the new one, never a half-written one under a real name.
Everything is loaded with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from rlhf_dist.errors import ConfigError
from rlhf_dist.files import atomic_write_text, fsync_dir, fsync_file

FORMAT = 1
SHARDS = "training"  # the sharded training state's directory in a checkpoint
FAULT_ENV = "RLHF_DIST_FAULT"


class RankGroup(Protocol):
    """The part of distributed.Runtime checkpoints use (this layer cannot import it)."""

    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def is_main(self) -> bool: ...
    def barrier(self) -> None: ...
    def seed_per_rank(self, seed: int) -> None: ...


def maybe_fault(point: str, step: int) -> None:
    """Fault injection for the kill-and-resume tests: RLHF_DIST_FAULT=point:step SIGKILLs
    this process when it reaches `point` at `step` (as an OOM killer or preemption would);
    RLHF_DIST_FAULT=crash:point:step@RANK raises there on that rank only (a bug that one
    rank hits)."""
    spec = os.environ.get(FAULT_ENV)
    if spec and spec == f"{point}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)
    if spec and spec == f"crash:{point}:{step}@{os.environ.get('RANK', '0')}":
        raise RuntimeError(f"injected crash ({FAULT_ENV}={spec})")


def fault_active(point: str, step: int) -> bool:
    """Whether RLHF_DIST_FAULT=point:step names this point and step: a fault that is not a
    kill (skip_weight_sync:N leaves out the N-th weight sync to a rollout server, for the
    test of the post-sync check)."""
    return os.environ.get(FAULT_ENV) == f"{point}:{step}"


def _save(obj: object, path: Path) -> None:
    """torch.save, then fsync: the file is on disk before its directory is renamed."""
    torch.save(obj, path)
    fsync_file(path)


def rng_state() -> dict:
    """This process's python, numpy and torch generators; on a GPU also the current CUDA
    device's, which samples every token there (engine.sampling.sample_next draws on the
    logits' device): without it a resumed GPU run would replay the random stream of its
    seed."""
    np_state = np.random.get_state(legacy=True)
    assert isinstance(np_state, tuple)  # legacy form: numpy's global generator is MT19937
    state = {
        "python": random.getstate(),
        "numpy": {
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "gauss": (int(np_state[3]), float(np_state[4])),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Put back this process's generators from `rng_state()`'s dict (CUDA's only on a GPU)."""
    random.setstate(_as_tuple(state["python"]))
    n = state["numpy"]
    np.random.set_state(
        ("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["gauss"][0], n["gauss"][1])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():  # a GPU run resumed on a GPU
        torch.cuda.set_rng_state(state["cuda"])


def _as_tuple(x: Any) -> Any:
    """`x` with every list inside it a tuple: python's RNG state in the form
    random.setstate takes."""
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def save_checkpoint(
    runtime: RankGroup,
    root: Path,
    step: int,
    training_state: dict | None,
    trainer_state: dict,
    keep: int,
    write_shards: Callable[[Path], None] | None = None,
) -> Path:
    """Write checkpoint `step` atomically under `root` (all ranks call); returns its path.

    training_state: the gathered state (main process) written as training.pt, unless
    `write_shards` is given: every rank then calls it on the checkpoint's `training/`
    directory (FSDP2's shards, distributed.Runtime.sharded_state_writer)."""
    name = f"step-{step:06d}"
    final, tmp = root / name, root / f".tmp-{name}"
    if runtime.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    runtime.barrier()
    _save(rng_state(), tmp / f"rng-rank{runtime.rank:05d}.pt")
    if write_shards is not None:
        write_shards(tmp / SHARDS)
    if runtime.is_main:
        if write_shards is None:
            _save(training_state, tmp / "training.pt")
        maybe_fault("checkpoint", step)  # half-written: only the .tmp directory may exist
        _save(trainer_state, tmp / "trainer.pt")
        meta = {"format": FORMAT, "step": step, "world_size": runtime.world_size}
        (tmp / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
        fsync_file(tmp / "meta.json")
    runtime.barrier()
    if runtime.is_main:
        fsync_dir(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        atomic_write_text(root / "latest", name + "\n")
        _prune(root, keep)
    runtime.barrier()
    return final


def _prune(root: Path, keep: int) -> None:
    checkpoints = sorted(p for p in root.glob("step-*") if p.is_dir())
    for old in checkpoints[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def find_checkpoint(resume: str, output_dir: Path) -> Path | None:
    """The checkpoint `run.resume` names: "auto" = the latest under output_dir (None if
    there is none yet), or a path to a checkpoint directory."""
    if not resume:
        return None
    if resume == "auto":
        pointer = output_dir / "checkpoints" / "latest"
        if not pointer.exists():
            return None
        path = output_dir / "checkpoints" / pointer.read_text(encoding="utf-8").strip()
    else:
        path = Path(resume).expanduser()
    if not (path / "meta.json").is_file():
        raise ConfigError(f"run.resume: {str(path)!r} is not a complete checkpoint (no meta.json)")
    return path


class Checkpoint:
    """A loaded checkpoint: training state, trainer state and this rank's RNG.

    A sharded checkpoint's training state (`training/`) is read by `read_shards` (the
    runtime's read_training_state): whole, or None where the engine reads its own shards
    after `prepare` (`shards`, FSDP2)."""

    def __init__(
        self,
        path: Path,
        runtime: RankGroup,
        read_shards: Callable[[Path], dict | None] | None = None,
    ):
        self.path = path
        self.meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
        if self.meta.get("format") != FORMAT:
            raise ConfigError(
                f"run.resume: {str(path)!r} has checkpoint format {self.meta.get('format')}, expected {FORMAT}"
            )
        self.step = int(self.meta["step"])
        self.shards = path / SHARDS if (path / SHARDS).is_dir() else None
        self.training: dict | None = None
        if self.shards is None:
            self.training = torch.load(path / "training.pt", weights_only=True, map_location="cpu")
        elif read_shards is not None:
            self.training = read_shards(self.shards)
        self.trainer = torch.load(path / "trainer.pt", weights_only=True, map_location="cpu")
        self.same_world = self.meta["world_size"] == runtime.world_size
        self.runtime = runtime

    def restore_rng(self, seed: int) -> None:
        """This rank's RNG as saved; on a different world size there is no saved state for
        the new ranks, so every rank re-seeds from (seed, step) instead: training continues
        correctly but is not bitwise the run that would have continued on the old ranks."""
        if self.same_world:
            set_rng_state(
                torch.load(self.path / f"rng-rank{self.runtime.rank:05d}.pt", weights_only=True)
            )
        else:
            self.runtime.seed_per_rank(seed + 7919 * self.step)

    def load_weights_into(self, module: torch.nn.Module) -> None:
        """Copy the saved fp32 weights into an unprepared module (before partitioning);
        nothing where the engine reads its shards after `prepare` (training is None)."""
        if self.training is None:
            return
        params = dict(module.named_parameters())
        missing = [n for n in self.training["params"] if n not in params]
        if missing:
            raise ConfigError(
                f"run.resume: checkpoint has weights the model lacks, e.g. {missing[0]!r}"
            )
        with torch.no_grad():
            for name, value in self.training["params"].items():
                params[name].copy_(value.to(params[name].dtype))
