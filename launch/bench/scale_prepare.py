"""Build the inputs of the scale benchmarks: a random-init Llama policy and reward model of
a chosen shape, the demo task's tokenizer and prompts, saved as Hugging Face checkpoints.

The shapes are the ones the benchmarks are about, not the demo's: `deep` (hidden 64 x 24
layers, vocab 1000) makes ZeRO-3's per-parameter costs visible on a CPU; `lora` (hidden
256 x 12 layers) is the LoRA-vs-full comparison; `gpu` (~0.47B: hidden 1024 x 24 layers,
32k vocab) is the one-GPU suite's model. The model's vocabulary may be larger than the
tokenizer's (token ids beyond it are simply never fed): what matters here is the size of
the embedding and the output layer.

Usage: python launch/bench/scale_prepare.py OUT --shape deep|lora|gpu|tiny [--prompts 256]
Writes OUT/{policy,reward}/ (with the tokenizer) and OUT/prompts.jsonl.
"""

from __future__ import annotations

import argparse
from pathlib import Path

SHAPES = {
    # name: (hidden, layers, heads, kv heads, intermediate, vocab)
    "tiny": (64, 2, 4, 2, 256, 1000),
    "deep": (64, 24, 4, 4, 256, 1000),
    "lora": (256, 12, 4, 4, 1024, 1000),
    "gpu": (1024, 24, 16, 16, 4096, 32000),
}


def build(out: Path, shape: str, prompts: int, seed: int = 0) -> None:
    import torch
    from transformers import (
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
        LlamaForSequenceClassification,
    )

    from rlhf_dist.demo.task import write_task

    files = write_task(
        out / "task", n_sft=1, n_pref=1, n_pref_eval=1, n_prompts=prompts, n_eval_prompts=1
    )
    tokenizer = AutoTokenizer.from_pretrained(str(files.tokenizer_dir))
    hidden, layers, heads, kv, inter, vocab = SHAPES[shape]

    def config(**extra) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=max(vocab, len(tokenizer)), hidden_size=hidden, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=inter,
            max_position_embeddings=512, tie_word_embeddings=False, attention_dropout=0.0,
            pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id, **extra,
        )  # fmt: skip

    torch.manual_seed(seed)
    for name, model in (
        ("policy", LlamaForCausalLM(config())),
        ("reward", LlamaForSequenceClassification(config(num_labels=1))),
    ):
        model.save_pretrained(str(out / name), safe_serialization=True)
        tokenizer.save_pretrained(str(out / name))
        n = sum(p.numel() for p in model.parameters())
        print(f"{name}: {n / 1e6:.2f}M parameters ({shape}: hidden {hidden} x {layers} layers)")
    (out / "prompts.jsonl").write_bytes(files.prompts.read_bytes())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", default="deep", choices=sorted(SHAPES))
    ap.add_argument("--prompts", type=int, default=256)
    args = ap.parse_args()
    build(args.out, args.shape, args.prompts)


if __name__ == "__main__":
    main()
