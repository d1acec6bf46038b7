"""What one GPU can run of the weight sync's CUDA path (distributed/weight_sync.py;
docs/serving.md, "Weight sync"). NCCL refuses two ranks on one device, so the group of
trainer rank 0 and a server waits for a machine with two GPUs; this checks the rest:

1. the choice: `sync_backend` picks NCCL for an actor on the GPU when every server
   offers it, gloo when one does not;
2. the buckets of a bf16 Llama on the GPU (`weight_buckets`, 16 MiB): in order, every
   weight once, each bucket within the bound or a single weight;
3. an NCCL group of one rank (world 1: the store, the communicator made at the join,
   each bucket placed on the group's device without a copy and broadcast with the
   timeout), the walk's seconds and its GPU memory growth (`MemoryGrowth`: at most about
   one bucket, as the bound promises);
4. a gloo group of one rank on the same machine (a server without a GPU): the bucket is
   copied to the CPU before it is sent.

Its last line: `sync_cuda: ok buckets=N largest_mib=X walk_s=Y growth_mib=Z`, or
`sync_cuda: skipped (...)` without a GPU or NCCL.

Usage: python launch/bench/sync_cuda.py
"""

from __future__ import annotations

import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlhf_dist.distributed.process_exit import end_process
from rlhf_dist.distributed.weight_sync import (
    MemoryGrowth,
    SyncGroup,
    free_port,
    local_backends,
    sync_backend,
    weight_buckets,
)

BUCKET = 16 * 2**20


def main() -> None:
    if "nccl" not in local_backends():
        print("sync_cuda: skipped (no GPU or no NCCL in this torch)")
        return
    gpu = torch.device("cuda", torch.cuda.current_device())
    assert sync_backend(gpu, [["gloo", "nccl"]]) == "nccl"
    assert sync_backend(gpu, [["gloo", "nccl"], ["gloo"]]) == "gloo"
    cfg = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1536,
                      num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4)  # fmt: skip
    model = LlamaForCausalLM(cfg).to(gpu, torch.bfloat16)
    named = list(model.named_parameters())
    buckets = list(weight_buckets(named, BUCKET))
    sizes = [sum(p.numel() * p.element_size() for _, p in b) for b in buckets]
    assert [n for b in buckets for n, _ in b] == [n for n, _ in named]
    assert all(s <= BUCKET or len(b) == 1 for s, b in zip(sizes, buckets))

    group = SyncGroup("127.0.0.1", free_port(), 0, 1, timeout_s=60, backend="nccl")
    assert group.device == gpu
    torch.cuda.synchronize()
    start = time.perf_counter()
    with MemoryGrowth(gpu) as grown:
        for bucket in buckets:
            for _, p in bucket:
                sent = group.placed(p)
                assert sent.data_ptr() == p.data_ptr()  # on the GPU already: no copy
                group.broadcast(sent)
    walk_s = time.perf_counter() - start

    cpu_group = SyncGroup("127.0.0.1", free_port(), 0, 1, timeout_s=60)
    _, first = buckets[0][0]
    on_cpu = cpu_group.placed(first)
    assert on_cpu.device.type == "cpu" and torch.equal(cpu_group.broadcast(on_cpu), first.cpu())
    print(
        f"sync_cuda: ok buckets={len(buckets)} largest_mib={max(sizes) / 2**20:.1f} "
        f"walk_s={walk_s:.3f} growth_mib={grown.peak_bytes / 2**20:.1f}"
    )


if __name__ == "__main__":
    main()
    end_process(0)  # a process that made a gloo group leaves by os._exit (process_exit.py)
