"""One rank's view of ZeRO-3 vs unsharded: model-state bytes and generation time.

Run by launch/bench/engines.sh (MODES=probe) under `accelerate launch` (2 CPU ranks)
twice: once with the DeepSpeed stage-0 config (plain data parallel) and once with ZeRO-3. Writes one JSON file
per rank; `--out DIR --report` (one process) prints the table of both runs' files. A benchmark, never a test: figures depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from rlhf_dist.api import end_process
from rlhf_dist.distributed import Runtime
from rlhf_dist.models import DTYPES, quiet_transformers


def tiny_gpt(vocab: int = 1024, hidden: int = 256, layers: int = 4):
    """A ~5M-parameter random-init Llama, big enough that partitions dominate buffers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def held_bytes(engine) -> dict[str, int]:
    """Bytes of distinct tensor storages this rank holds for params, grads, optimizer.

    Walks the parameters (their ZeRO-3 partitions `ds_tensor` too), their grads, and every
    tensor reachable from the (ZeRO) optimizer within a few attribute hops: fp32 master
    partitions, Adam moments, gradient partitions and communication buckets alike.
    """
    seen: set[int] = set()

    def add(t) -> int:
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            return 0
        s = t.untyped_storage()
        if s.data_ptr() in seen:
            return 0
        seen.add(s.data_ptr())
        return s.nbytes()

    params = sum(
        add(p.data) + add(getattr(p, "ds_tensor", None)) for p in engine.module.parameters()
    )
    grads = sum(add(p.grad) for p in engine.module.parameters())
    optim = walk(engine.optimizer, add, depth=4)
    return {
        "params": params,
        "grads": grads,
        "optimizer_and_buffers": optim,
        "total": params + grads + optim,
    }


def walk(obj, add, depth: int, _ids=None) -> int:
    _ids = set() if _ids is None else _ids
    if depth < 0 or id(obj) in _ids or isinstance(obj, (str, bytes, int, float, torch.nn.Module)):
        return 0
    _ids.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return add(obj)
    if isinstance(obj, dict):
        items = list(obj.values()) + [k for k in obj if isinstance(k, torch.Tensor)]
    elif isinstance(obj, (list, tuple, set)):
        items = list(obj)
    elif hasattr(obj, "__dict__"):
        items = list(vars(obj).values())
    else:
        return 0
    return sum(walk(x, add, depth - 1, _ids) for x in items)


def time_generation(runtime, model, prompts, mask, new_tokens: int, repeats: int, context) -> float:
    """Median seconds to generate `new_tokens` for the prompts (EOS suppressed)."""
    times = []
    for _ in range(repeats):
        runtime.barrier()
        start = time.perf_counter()
        with context() as (module, keep_in_step), torch.no_grad():
            module.generate(
                input_ids=prompts, attention_mask=mask, do_sample=True, temperature=0.7, top_k=0,
                max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0, eos_token_id=2,
                synced_gpus=keep_in_step is not None,
            )  # fmt: skip
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--out", required=True, help="directory for one JSON file per rank")
    parser.add_argument("--report", action="store_true", help="print the table of --out's rows")
    args = parser.parse_args()
    if args.report:
        return report(Path(args.out))
    quiet_transformers()
    runtime = Runtime(seed=0, dtype=args.dtype)
    model = tiny_gpt().to(DTYPES[args.dtype])
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, optimizer = runtime.prepare(model, optimizer, 4, 1, 1.0, args.dtype)
    ids = torch.randint(3, 1024, (4, 16))
    for step in range(2):
        logits = engine(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        runtime.micro_backward(engine, logits.float().logsumexp(-1).mean(), last=True)
        if step == 1:
            # After a step (Adam moments exist) and a backward (gradients exist): the
            # peak set of model states of a training iteration.
            memory = held_bytes(engine)
        runtime.optimizer_step(engine, optimizer, [1.0])
    prompts = torch.randint(3, 1024, (args.prompts, 8))
    mask = torch.ones_like(prompts)
    gathered = time_generation(
        runtime,
        engine,
        prompts,
        mask,
        args.new_tokens,
        args.repeats,
        lambda: runtime.generation_context(engine, None, True),
    )
    per_layer = None
    if runtime.zero_stage == 3:
        per_layer = time_generation(
            runtime,
            engine,
            prompts,
            mask,
            args.new_tokens,
            args.repeats,
            lambda: runtime.generation_context(engine, None, False),
        )
    with runtime.local_loading():
        plain = tiny_gpt().to(DTYPES[args.dtype])
    plain.eval()
    unsharded = time_generation(
        runtime, plain, prompts, mask, args.new_tokens, args.repeats, lambda: _plain(plain)
    )
    row = {
        "rank": runtime.rank, "world_size": runtime.world_size, "zero_stage": runtime.zero_stage,
        "params": n_params, "model_state_bytes": memory,
        "generate_s": gathered, "generate_per_layer_gather_s": per_layer, "generate_unsharded_s": unsharded,
        "threads": torch.get_num_threads(), "dtype": args.dtype,
    }  # fmt: skip
    path = Path(args.out) / f"stage{runtime.zero_stage}_rank{runtime.rank}.json"
    path.write_text(json.dumps(row), encoding="utf-8")


def report(out: Path) -> None:
    """The table of launch/bench/engines.sh (MODES=probe) from the per-rank JSON rows in `out`."""
    rows = [json.loads(p.read_text()) for p in sorted(out.glob("stage*_rank*.json"))]
    mib = 1 / 2**20
    print(
        f"model: {rows[0]['params'] / 1e6:.2f}M params ({rows[0]['dtype']}), {rows[0]['world_size']} ranks, {rows[0]['threads']} thread(s) each"
    )
    print(
        "stage rank  params MiB  grads MiB  optim+buffers MiB  total MiB | generate s  unsharded s  ratio  per-layer-gather s"
    )
    base = {}
    for r in sorted(rows, key=lambda r: (r["zero_stage"], r["rank"])):
        m = r["model_state_bytes"]
        ratio = r["generate_s"] / r["generate_unsharded_s"]
        per_layer = r["generate_per_layer_gather_s"]
        print(
            f"{r['zero_stage']:>5} {r['rank']:>4} {m['params'] * mib:>11.2f} {m['grads'] * mib:>10.2f} "
            f"{m['optimizer_and_buffers'] * mib:>18.2f} {m['total'] * mib:>10.2f} | {r['generate_s']:>10.3f} "
            f"{r['generate_unsharded_s']:>12.3f} {ratio:>6.2f} {per_layer if per_layer is None else round(per_layer, 3)!s:>19}"
        )
        base.setdefault(r["zero_stage"], []).append(m["total"])
    if 0 in base and 3 in base:
        share = max(base[3]) / max(base[0])
        print(f"ZeRO-3 per-rank model states = {share:.2f} x stage 0 (ideal with 2 ranks: 0.50)")


class _plain:
    def __init__(self, model):
        self.model = model

    def __enter__(self):
        return self.model, False

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
    sys.exit(end_process())  # a rank leaves without interpreter teardown (api.end_process)
