"""The RNG state a checkpoint holds (rlhf_dist/checkpoint.py): restoring it replays every
generator a run samples with, the CUDA device's included (a GPU run samples its tokens
and its minibatch order there), through torch.save / weights_only load as on resume."""

from __future__ import annotations

import random

import numpy as np
import torch

from rlhf_dist.checkpoint import rng_state, set_rng_state


def draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(4).tolist()


def test_restoring_the_saved_state_replays_every_generator(tmp_path):
    torch.save(rng_state(), tmp_path / "rng.pt")
    first = draws()
    draws()  # the generators move on, as a killed run's did
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert draws() == first


def test_a_gpu_run_saves_and_restores_the_cuda_generator(monkeypatch, tmp_path):
    """Faked CUDA calls (the suite runs on CPU): the device generator's state goes into the
    checkpoint and back; without a GPU at resume it is skipped, and a process that never
    initialised CUDA saves none."""
    device_state = torch.arange(16, dtype=torch.uint8)
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": device_state.clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, device="cuda": restored.append(s))
    torch.save(rng_state(), tmp_path / "rng.pt")
    state = torch.load(tmp_path / "rng.pt", weights_only=True)
    set_rng_state(state)
    assert len(restored) == 1 and torch.equal(restored[0], device_state)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    set_rng_state(state)  # resumed on a CPU machine: the CPU generators only
    assert len(restored) == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert "cuda" not in rng_state()
