"""Rollout time per iteration, hf backend vs vLLM, same model and prompts, one process.

For each model size: random-init Llama saved to disk, 64 prompts of 8-16 tokens, 32 new
tokens per response (no stop ids, so both backends produce exactly that many tokens;
min_new_tokens would cost vLLM a Python logits processor per request and step), temperature 1. After one warm-up call each, `--repeats`
timed calls; the vLLM column includes the weight sync that precedes every rollout
(VLLMEngine.load_weights), shown separately too. Prints one markdown table.

    python launch/bench/vllm_rollout.py [--sizes tiny,base] [--repeats 5]
"""

from __future__ import annotations

import argparse
import copy
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
    from rlhf_dist.data.rows import left_pad

    g = torch.Generator().manual_seed(0)
    rows = [
        [1]
        + torch.randint(
            3, vocab, (int(torch.randint(8, 17, (1,), generator=g)),), generator=g
        ).tolist()
        for _ in range(n)
    ]
    return left_pad(rows, 0)


def timed(fns: dict, repeats: int) -> dict:
    """Median seconds of each callable, called in turn `repeats` times after one warm-up
    call each: alternating, so a change in machine load hits every column alike."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def bench(size: str, root: Path, repeats: int, new_tokens: int) -> dict:
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from rlhf_dist.config import GenerationConfig, config_from_dict
    from rlhf_dist.engine.decode import generate
    from rlhf_dist.generation.vllm import VLLMEngine

    path = build(size, root)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    ids, mask = prompts()
    gen = GenerationConfig(max_new_tokens=new_tokens, temperature=1.0)
    tok = SimpleNamespace(pad_token_id=0, eos_token_id=2)
    cfg = config_from_dict({"model": {"policy": str(path)}})
    start = time.perf_counter()
    engine = VLLMEngine(cfg, torch.device("cpu"))
    load = time.perf_counter() - start
    lora_model = with_adapters(copy.deepcopy(model))  # peft wraps layers in place

    def vllm_rollout():
        engine.load_weights(model)
        engine.generate(ids, mask, gen, (), 0)

    def hf_rollout():
        generate(model, ids, mask, gen, tok, None, ())

    out = timed(
        {
            "hf": hf_rollout,
            "vllm": vllm_rollout,
            "sync": lambda: engine.load_weights(model),
            "lora_sync": lambda: sync_lora(engine, lora_model),
        },
        repeats,
    )
    params = sum(p.numel() for p in model.parameters()) / 1e6
    return {"size": size, "params_m": params, "load": load, **out}


def with_adapters(model):
    """`model` with LoRA adapters (r=8, nonzero) on every linear layer of its blocks."""
    from peft import LoraConfig, get_peft_model

    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=modules, init_lora_weights=False)
    return get_peft_model(model, cfg)


def sync_lora(engine, lora_model) -> None:
    """A LoRA actor's sync: adapters merged into copies of the base weights, loaded, the
    originals put back (what a LoRA run does before each rollout)."""
    from rlhf_dist.models.lora import merged_adapters

    with merged_adapters(lora_model) as merged:
        engine.load_weights(merged)


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
        "| model | params (M) | hf s | vllm s (incl. sync) | hf / vllm | sync s | "
        "LoRA merge + sync s | engine start s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['size']} | {r['params_m']:.1f} | {r['hf']:.3f} | {r['vllm']:.3f} | "
            f"{r['hf'] / r['vllm']:.2f}x | {r['sync']:.3f} | {r['lora_sync']:.3f} | "
            f"{r['load']:.1f} |"
        )


if __name__ == "__main__":
    main()
