"""Rollout time per iteration, hf backend vs vLLM, same model and prompts, one process.

For each model size: random-init Llama saved to disk, 64 prompts of 8-16 tokens, 32 new
tokens per response (min_new_tokens = max_new_tokens, so both backends produce exactly
the same number of tokens), temperature 1. After one warm-up call each, `--repeats`
timed calls; the vLLM column includes the weight sync that precedes every rollout
(VLLMEngine.load_weights), shown separately too. Prints one markdown table.

    python launch/bench/vllm_rollout.py [--sizes tiny,base] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

SIZES = {
    # the demo's policy shape (2 heads of 32)
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256),
    # a deeper, wider model where the forward, not Python, dominates
    "base": dict(
        hidden_size=512, num_hidden_layers=8, num_attention_heads=8, intermediate_size=1536
    ),
}


def build(size: str, root: Path, vocab: int = 8000) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab, max_position_embeddings=128, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, **SIZES[size],
    )  # fmt: skip
    path = root / size
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def prompts(n: int = 64, vocab: int = 8000):
    from rlhf_dist.data import left_pad

    g = torch.Generator().manual_seed(0)
    rows = [
        [1]
        + torch.randint(
            3, vocab, (int(torch.randint(8, 17, (1,), generator=g)),), generator=g
        ).tolist()
        for _ in range(n)
    ]
    return left_pad(rows, 0)


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench(size: str, root: Path, repeats: int, new_tokens: int) -> dict:
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from rlhf_dist.config import GenerationConfig, config_from_dict
    from rlhf_dist.rollout import generate
    from rlhf_dist.vllm_rollout import VLLMEngine

    path = build(size, root)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    ids, mask = prompts()
    gen = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, temperature=1.0)
    tok = SimpleNamespace(pad_token_id=0, eos_token_id=2)
    hf = timed(lambda: generate(model, ids, mask, gen, tok, None, (2,)), repeats)
    cfg = config_from_dict({"model": {"policy": str(path)}})
    start = time.perf_counter()
    engine = VLLMEngine(cfg, torch.device("cpu"))
    load = time.perf_counter() - start
    sync = timed(lambda: engine.load_weights(model), repeats)

    def vllm_rollout():
        engine.load_weights(model)
        engine.generate(ids, mask, gen, (2,), 0)

    vllm = timed(vllm_rollout, repeats)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    return {"size": size, "params_m": params, "hf": hf, "vllm": vllm, "sync": sync, "load": load}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="tiny,base")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    rows = []
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        for size in args.sizes.split(","):
            rows.append(bench(size, Path(tmp), args.repeats, args.new_tokens))
    print(
        f"\n64 prompts x {args.new_tokens} new tokens, {torch.get_num_threads()} threads, "
        f"median of {args.repeats} after a warm-up"
    )
    print(
        "| model | params (M) | hf s | vllm s (incl. sync) | sync s | hf / vllm | engine start s |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['size']} | {r['params_m']:.1f} | {r['hf']:.3f} | {r['vllm']:.3f} | "
            f"{r['sync']:.3f} | {r['hf'] / r['vllm']:.2f}x | {r['load']:.1f} |"
        )


if __name__ == "__main__":
    main()
