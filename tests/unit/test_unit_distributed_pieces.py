"""Pieces of the distributed layer on their own, without Accelerate: the DeepSpeed config
filling (plain dicts) and the numerical guard on a one-rank stand-in backend."""

from __future__ import annotations

import types

import pytest
import torch

from rlhf_dist.config import ConfigError
from rlhf_dist.distributed import NumericalGuard
from rlhf_dist.distributed.deepspeed_config import (
    MIN_BUCKET,
    fill_deepspeed_config,
    fill_gloo_zero3,
    fill_zero_buckets,
)


def test_auto_entries_are_filled_from_the_run_config_and_conflicts_refused():
    ds = {"train_batch_size": "auto", "gradient_clipping": 1.0, "bf16": {"enabled": "auto"}}
    fill_deepspeed_config(ds, 2, 4, 2, 1.0, "bfloat16")
    assert ds["train_micro_batch_size_per_gpu"] == 2 and ds["gradient_accumulation_steps"] == 4
    assert ds["train_batch_size"] == 16 and ds["bf16"] == {"enabled": True}
    with pytest.raises(ConfigError, match="gradient_clipping"):
        fill_deepspeed_config({"gradient_clipping": 0.5}, 2, 4, 2, 1.0, "float32")


def test_zero_buckets_follow_the_largest_hidden_size_and_keep_explicit_values():
    model = torch.nn.Module()
    model.config = types.SimpleNamespace(hidden_size=8)
    model.weight = torch.nn.Parameter(torch.zeros(8000))
    ds = {"zero_optimization": {"reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": 7}}
    fill_zero_buckets(ds, model)
    # hidden^2 = 64 is below the floors: the gradient bucket holds all 8000 trained
    # parameters (one reduce per step), prefetching an eighth of them.
    assert ds["zero_optimization"] == {"reduce_bucket_size": 8000, "stage3_prefetch_bucket_size": 7}
    ds = {"zero_optimization": {"stage3_prefetch_bucket_size": "auto"}}
    fill_zero_buckets(ds, model)
    assert ds["zero_optimization"] == {"stage3_prefetch_bucket_size": 1000}
    # A large model (meta tensors: no memory): the floor is DeepSpeed's default...
    model.weight = torch.nn.Parameter(torch.empty(8 * MIN_BUCKET + 8, device="meta"))
    ds = {"zero_optimization": {"reduce_bucket_size": "auto"}}
    fill_zero_buckets(ds, model)
    assert ds["zero_optimization"]["reduce_bucket_size"] == MIN_BUCKET
    # ...and a hidden size whose square is larger wins over it.
    model.config = types.SimpleNamespace(hidden_size=16384)
    ds = {"zero_optimization": dict.fromkeys(("reduce_bucket_size", "stage3_param_persistence_threshold"), "auto")}  # fmt: skip
    fill_zero_buckets(ds, model)
    assert ds["zero_optimization"]["reduce_bucket_size"] == 16384**2
    assert ds["zero_optimization"]["stage3_param_persistence_threshold"] == 0


def test_gloo_zero3_fetches_by_all_reduce_unless_the_deepspeed_config_says_otherwise():
    ds = {"zero_optimization": {"stage": 3}}
    fill_gloo_zero3(ds)
    assert ds["zero_optimization"]["stage3_use_all_reduce_for_fetch_params"] is True
    ds = {"zero_optimization": {"stage3_use_all_reduce_for_fetch_params": False}}
    fill_gloo_zero3(ds)
    assert ds["zero_optimization"]["stage3_use_all_reduce_for_fetch_params"] is False


def one_rank_backend():
    """What the guard reads of a Backend: one rank, no DeepSpeed, plain backward."""
    accelerator = types.SimpleNamespace(backward=lambda loss: loss.backward())
    return types.SimpleNamespace(
        rank=0,
        world_size=1,
        zero_stage=None,
        engine="single",
        device=torch.device("cpu"),
        accelerator=accelerator,
    )


def test_guard_skips_a_non_finite_step_counts_it_and_steps_the_next():
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    guard = NumericalGuard(one_rank_backend())
    assert not guard.micro_backward(None, (weight * float("nan")).sum(), last=True)
    assert guard.optimizer_step(None, optimizer, [1.0]) is None
    assert (guard.skipped_steps, guard.bad_steps_in_row) == (1, 1)
    assert torch.equal(weight.detach(), torch.ones(3)) and weight.grad is None
    assert guard.micro_backward(None, weight.sum(), last=True)
    norms = guard.optimizer_step(None, optimizer, [10.0])  # grad [1, 1, 1]: norm sqrt(3)
    assert norms == pytest.approx([3**0.5]) and guard.bad_steps_in_row == 0
    assert torch.allclose(weight.detach(), torch.full((3,), 0.9))


RSS_AFTER_FREE = """
import sys, torch
from rlhf_dist.engine.cpu import retain_freed_host_memory
if sys.argv[1] == "retain":
    assert retain_freed_host_memory()
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
x = torch.ones(64 * 2**20)  # 256 MiB, every page touched
held = rss()
del x
print(held - rss())
"""


@pytest.mark.skipif(
    not __import__("rlhf_dist.engine.cpu", fromlist=["_glibc_version"])._glibc_version(),
    reason="glibc's malloc only",
)
def test_retained_host_memory_stays_in_the_process_for_the_next_tensor():
    """perf.retain_host_memory: a freed 256 MiB tensor stays resident (its pages serve the
    next one without faults); by default glibc hands it back to the OS at once."""
    import subprocess
    import sys

    def released(mode):
        out = subprocess.run(
            [sys.executable, "-c", RSS_AFTER_FREE, mode], capture_output=True, text=True,
            check=True,
        )  # fmt: skip
        return int(out.stdout.split()[-1])

    assert released("default") > 200 * 2**20
    assert released("retain") < 16 * 2**20
