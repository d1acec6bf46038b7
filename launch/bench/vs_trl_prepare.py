"""Build the shared inputs of the rlhf_dist-vs-TRL benchmark (run in the project's .venv).

Both trainers must read the SAME weights, tokenizer and prompts, so they are built once
here and saved as plain Hugging Face checkpoints: TRL loads them with `from_pretrained`,
`rlhf-dist ppo` through `model.policy` / `model.reward`. The models are random-init (the
demo's tiny Llama): a benchmark of the loop, not of learning.

Usage: python launch/bench/vs_trl_prepare.py OUT_DIR [--size tiny|small] [--prompts 256]
Writes OUT_DIR/{tokenizer,policy,reward}/, OUT_DIR/prompts.jsonl and OUT_DIR/ours.yaml.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rlhf_dist.demo.task import build_tiny_models, write_task

# Settings shared by both trainers; vs_trl.sh passes the same numbers to vs_trl_trl.py.
ROLLOUT_BATCH = 32
RESPONSE_LENGTH = 32
PPO_EPOCHS = 4
MINIBATCHES = 4
TEMPERATURE = 0.7


def ours_yaml(out: Path, iterations: int, precision: str = "fp32") -> str:
    """The `rlhf-dist ppo` config matching the TRL run (run.output_dir is set per round).
    precision bf16: bf16 weights for all four models (TRL: bf16 autocast, its default)."""
    minibatch = ROLLOUT_BATCH // MINIBATCHES
    cfg = {
        "model": {
            "policy": str(out / "policy"),
            "reward": str(out / "reward"),
            "dtype": "bfloat16" if precision == "bf16" else "float32",
        },
        "data": {"train": str(out / "prompts.jsonl")},
        "run": {
            # Histograms and sample tables are extra work TRL does not do each iteration;
            # TRL's sample generations are turned off likewise (num_sample_generations=0).
            "histogram_every": 0,
            "samples_every": 0,
            "progress": False,
        },
        "perf": {"num_threads": 0},  # = all cores for one process, like TRL's torch default
        "ppo": {
            "iterations": iterations,
            "rollout_batch_size": ROLLOUT_BATCH,
            "rollout_micro_batch_size": ROLLOUT_BATCH,  # TRL: local_rollout_forward_batch_size
            "ppo_epochs": PPO_EPOCHS,
            "minibatch_size": minibatch,
            "micro_batch_size": minibatch,  # one forward/backward per optimizer step, as TRL
            "critic_init": "reward",  # TRL's value model is a copy of the reward model too
            "kl_coef": 0.05,
            "kl_kind": "k1",
            "whiten_advantages": True,
        },
        # EOS suppressed until 32 tokens: every response is exactly 32 tokens long, as TRL's
        # with stop_token=None (its generation config then has no EOS at all).
        "generation": {
            "min_new_tokens": RESPONSE_LENGTH,
            "max_new_tokens": RESPONSE_LENGTH,
            "temperature": TEMPERATURE,
            "top_k": 0,
            "top_p": 1.0,
        },
    }
    return json.dumps(cfg, indent=2) + "\n"  # JSON is YAML


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--size", default="tiny", choices=("tiny", "small"))
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    args = ap.parse_args()
    out = args.out
    # The demo task gives a tokenizer and a prompt file; the SFT/preference files are
    # not needed, so they are made minimal.
    files = write_task(
        out / "task", n_sft=1, n_pref=1, n_pref_eval=1, n_prompts=args.prompts, n_eval_prompts=1
    )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(files.tokenizer_dir))
    build_tiny_models(out, tokenizer, size=args.size, seed=0)
    (out / "prompts.jsonl").write_bytes(files.prompts.read_bytes())
    (out / "ours.yaml").write_text(
        ours_yaml(out, args.iterations, args.precision), encoding="utf-8"
    )
    print(f"prepared {out} (model size {args.size}, {args.precision}, {args.prompts} prompts)")


if __name__ == "__main__":
    main()
