"""Peak memory of one critic-free PPO iteration with a real vocabulary (issue #23).

A narrow random Llama (hidden 64, 2 layers) with Qwen's 151,936-token vocabulary runs one
GRPO iteration through the real trainer (`rlhf-dist ppo` in a subprocess): 2 prompts x 4
samples = 8 responses of exactly 512 tokens (min_new_tokens = max_new_tokens), k3 KL in
the loss, one optimizer step per rollout, a Python reward function. The model has ~10M
parameters, so the peak is about the (B, T, V) logits: a whole fp32 copy of them is
8 x 512 x 151,936 x 4 bytes = 2.3 GiB.

    python launch/bench/memory_vocab.py OUT [--vocab 151936] [--tokens 512] [KEY=VALUE ...]

Prints the subprocess's peak RSS (getrusage of the child: the whole run, model load
included) and the phase times the run logged. Extra KEY=VALUE pairs are passed on as
config overrides (e.g. perf.logprob_chunk_tokens=256). Run it with PYTHONPATH set to the
tree to measure (the "before" figures of docs/benchmarks.md come from main's tree).
Times on the shared 2-core CPU are noisy; memory is the figure this measures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

PHASES = ("time/generate", "time/score", "time/update", "time/total", "memory/peak_gib")


def build_policy(out: Path, vocab: int, tokens: int) -> Path:
    """A random narrow Llama with `vocab` output rows and the demo tokenizer (ids past the
    tokenizer's own are sampled but decode to nothing)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from rlhf_dist.demo.task import write_task

    files = write_task(
        out / "task", n_sft=1, n_pref=1, n_pref_eval=1, n_prompts=64, n_eval_prompts=1
    )
    tok = AutoTokenizer.from_pretrained(str(files.tokenizer_dir))
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=256, max_position_embeddings=tokens + 128,
        tie_word_embeddings=False, attention_dropout=0.0, pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    path = out / "policy"
    LlamaForCausalLM(config).save_pretrained(str(path), safe_serialization=True)
    tok.save_pretrained(str(path))
    return files.prompts


def run_config(out: Path, prompts: Path, tokens: int) -> dict:
    return {
        "run": {"output_dir": str(out / "run"), "histogram_every": 0, "samples_every": 0,
                "progress": False},
        "model": {"policy": str(out / "policy"), "attn_implementation": "eager"},
        "data": {"train": str(prompts)},
        "generation": {"max_new_tokens": tokens, "min_new_tokens": tokens, "temperature": 1.0},
        "reward": {"function": "rlhf_dist.demo.task:positive_word_reward"},
        "ppo": {"iterations": 1, "estimator": "grpo", "rollout_batch_size": 2,
                "samples_per_prompt": 4, "rollout_micro_batch_size": 8, "ppo_epochs": 1,
                "minibatch_size": 8, "micro_batch_size": 8, "kl_placement": "loss",
                "kl_kind": "k3", "kl_coef": 0.04},
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = build_policy(args.out, args.vocab, args.tokens)
    cfg_path = args.out / "ppo.yaml"
    cfg_path.write_text(yaml.safe_dump(run_config(args.out, prompts, args.tokens)))
    cmd = [sys.executable, "-m", "rlhf_dist", "ppo", "--config", str(cfg_path), *args.overrides]
    child = subprocess.Popen(cmd, env=os.environ.copy())
    _, status, usage = os.wait4(child.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"the run failed (exit {os.waitstatus_to_exitcode(status)})")
    rows = [json.loads(line) for line in (args.out / "run/metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    print(f"vocab {args.vocab}, 8 responses x {args.tokens} tokens, overrides {args.overrides}")
    print(f"peak RSS of the run: {usage.ru_maxrss / 2**20:.2f} GiB")  # ru_maxrss is in KiB
    for key in PHASES:
        print(f"{key}: {last.get(key, float('nan')):.2f}")


if __name__ == "__main__":
    main()
