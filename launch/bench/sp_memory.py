"""Per-rank peak memory of one SFT step with distributed.sequence_parallel_size 1 and 2, on
2 CPU ranks (issue 35 item 1).

    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml \
        launch/bench/sp_memory.py [--length 4096] [--hidden 256] [--layers 4]

Every rank builds the same random Llama (8 heads, 4 key/value heads) and takes one
sequence of --length tokens (the whole global batch: 2 sequences, one per rank), then
runs `trainers.sft.sft_step` (micro-batches of one sequence) twice unmeasured (so that the
gradients, DDP's buckets and lazily made buffers exist) and once measured. With sp=2 the
two ranks pool their two sequences and run each split in halves. Measured by counting
torch's CPU allocations from every thread (cpu_memory.py; the profiler's records miss the
frees gloo's threads make): the peak during the step over what was held when it began,
i.e. the step's activations and transients (the weights, gradients and Adam moments were
allocated before). A fourth
step counts the activations themselves: the bytes autograd saves for one micro-batch's
backward (saved-tensor hooks, unique storages, weights left out), which excludes the
fixed-size transients the peak also holds (the log-prob head's (2, 512, V) workspace).
Prints each
rank's peak for sp=1 and sp=2 and their ratio, and the planner's update phase activations
for the same shapes (`rlhf_dist.planning`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpu_memory  # noqa: E402 (this directory)

from rlhf_dist.api import end_process
from rlhf_dist.config import OptimConfig, PerfConfig  # noqa: E402
from rlhf_dist.data.batching import BatchPlan  # noqa: E402
from rlhf_dist.data.rows import SFTExample  # noqa: E402
from rlhf_dist.distributed import Runtime, seed_everything  # noqa: E402
from rlhf_dist.models import quiet_transformers  # noqa: E402
from rlhf_dist.trainers.common import make_optimizer  # noqa: E402
from rlhf_dist.trainers.sft import sft_step  # noqa: E402

VOCAB = 4096


def llama(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    seed_everything(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=8, num_key_value_heads=4, intermediate_size=args.hidden * 11 // 4,
        max_position_embeddings=args.length + 8, attention_dropout=0.0, pad_token_id=0,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def saved_activations(runtime: Runtime, step) -> int:
    """The most bytes any one micro-batch of `step()` saves for its backward (autograd's
    saved tensors, unique storages, the weights left out): the activations alive when its
    backward starts, which is where the step peaks."""
    per_micro: list[dict[int, int]] = [{}]
    weights: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if isinstance(t, torch.nn.Parameter):
            weights.add(storage.data_ptr())
        per_micro[-1].setdefault(storage.data_ptr(), storage.nbytes())
        return t

    backward = runtime.micro_backward

    def counted(*args, **kwargs):
        done = backward(*args, **kwargs)
        per_micro.append({})
        return done

    runtime.micro_backward = counted  # type: ignore[method-assign]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            step()
    finally:
        del runtime.micro_backward  # the class's method again
    return max(sum(n for p, n in m.items() if p not in weights) for m in per_micro)


def step_peak(runtime: Runtime, args) -> tuple[int, int]:
    """This rank's (peak bytes over held, saved activations) of one measured SFT step
    (after two unmeasured ones)."""
    net = llama(args)
    optimizer = make_optimizer([(net.parameters(), OptimConfig())])
    model, _ = runtime.prepare(net, optimizer, 1, 1, 1.0, "float32")
    model.train()
    g = torch.Generator().manual_seed(1)
    examples = [
        SFTExample(torch.randint(2, VOCAB, (args.length,), generator=g).tolist(), 64)
        for _ in range(runtime.world_size)
    ]
    plan = BatchPlan(runtime.world_size, runtime.world_size, 1)
    perf = PerfConfig()

    def step():
        sft_step(runtime, model, examples, plan, 0, perf)

    # Two unmeasured steps: the first measured step after only one still counted lazily
    # made allocations (0.60 vs 0.72 of sp=1 on rank 0, the same run repeated).
    for _ in range(2):
        step()
    optimizer.zero_grad(set_to_none=False)  # the gradients stay allocated: not measured
    runtime.barrier()
    cpu_memory.reset_peak()
    start = cpu_memory.held()
    step()
    peak = cpu_memory.peak() - start
    runtime.barrier()
    optimizer.zero_grad(set_to_none=False)
    saved = saved_activations(runtime, step)
    runtime.barrier()
    return peak, saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    cpu_memory.install()
    quiet_transformers()
    peaks = {}
    for n in (1, 2):
        runtime = Runtime(seed=0, num_threads=1, sequence_parallel_size=n)
        peaks[n] = runtime.gather_objects([step_peak(runtime, args)])
    if runtime.is_main:
        mib = 2**20
        print(f"SFT step, {args.length}-token sequences, hidden {args.hidden}, "
              f"{args.layers} layers, 8 heads / 4 KV heads, vocab {VOCAB}, fp32, 2 ranks")  # fmt: skip
        for r in range(runtime.world_size):
            (one, one_saved), (two, two_saved) = peaks[1][r], peaks[2][r]
            print(f"rank {r}: peak over held  sp=1 {one / mib:8.1f} MiB  sp=2 {two / mib:8.1f} MiB"
                  f"  ratio {two / one:.3f}")  # fmt: skip
            print(f"        activations saved sp=1 {one_saved / mib:8.1f} MiB  sp=2 {two_saved / mib:8.1f} MiB"
                  f"  ratio {two_saved / one_saved:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
    sys.exit(end_process())  # a rank leaves without interpreter teardown (api.end_process)
