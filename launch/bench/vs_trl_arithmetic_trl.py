"""TRL's GRPOTrainer on the arithmetic demo's task and settings (run in .venv-trl-grpo).

Usage: python launch/bench/vs_trl_arithmetic_trl.py PREPARED_DIR RESULT_JSON --output-dir DIR
         [--seed 0] [--adam-epsilon 1e-8] [--shuffle]

PREPARED_DIR is what vs_trl_arithmetic_prepare.py wrote. The same SmolLM2 weights, chat
template, training rows (TRL in file order, ours in its seeded order), reward (rlhf_dist's
`last_number`, pure Python, imported from this checkout), 8 prompts x 8 samples at
temperature 1, 24 new tokens, one optimizer step per rollout at lr 2e-5 (constant, AdamW),
no KL (beta 0), token-mean loss (TRL's "dapo" aggregation), group-std-normalised
advantages, fp32, 2 threads. Saves the trained policy in DIR/final for the demo's own
held-out evaluation, and writes {"seconds": [per iteration], "train_seconds"} to RESULT_JSON.
--adam-epsilon: transformers' 1e-8 by default; 1e-5 is ours (the only setting in which the
two updates differ on a fixed batch, launch/bench/vs_trl_loss_check.py). --shuffle: TRL
shuffles the rows by seed (as ours does); without it every seed trains in file order.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))  # the checkout: rlhf_dist.rewards.tasks, torch-free
from trl_timer import IterationTimer  # noqa: E402

from rlhf_dist.rewards.tasks import last_number  # noqa: E402


def reward(prompts, completions, answer, **kwargs) -> list[float]:
    """TRL's reward_funcs signature over rlhf_dist's `last_number` (message completions)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return last_number(prompts, texts, answer)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prepared", type=Path)
    ap.add_argument("result", type=Path)
    ap.add_argument("--output-dir", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--adam-epsilon", type=float, default=1e-8)
    ap.add_argument("--shuffle", action="store_true")
    args = ap.parse_args()
    s = json.loads((args.prepared / "settings.json").read_text(encoding="utf-8"))
    torch.set_num_threads(s["threads"])
    rows = s["prompts_per_iteration"] * s["samples_per_prompt"]
    lines = (args.prepared / "train.jsonl").read_text(encoding="utf-8").splitlines()
    dataset = Dataset.from_list([json.loads(line) for line in lines])
    config = GRPOConfig(
        output_dir=str(args.output_dir), use_cpu=not torch.cuda.is_available(), seed=args.seed,
        # fp32 and no activation checkpointing, as ours runs. TRL's defaults are bf16 autocast
        # (on a CPU without AVX-512 BF16 or AMX a reference GEMM: 882 s a step on a 2-core AMD
        # EPYC, against 88 s in fp32) and gradient checkpointing.
        bf16=False, gradient_checkpointing=False,
        per_device_train_batch_size=rows, gradient_accumulation_steps=1,
        num_generations=s["samples_per_prompt"], num_iterations=1,
        max_completion_length=s["new_tokens"], temperature=s["temperature"], top_k=0, top_p=1.0,
        beta=s["kl_coef"], loss_type="dapo", scale_rewards="group", learning_rate=s["lr"],
        lr_scheduler_type="constant", warmup_steps=0, max_steps=s["iterations"],
        adam_epsilon=args.adam_epsilon, shuffle_dataset=args.shuffle, logging_steps=1, report_to=[], save_strategy="no",
        log_completions=False, dataloader_num_workers=0, use_vllm=False,
    )  # fmt: skip
    timer = IterationTimer()
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(s["policy"], dtype=torch.float32),
        reward_funcs=[reward], args=config, train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(s["policy"]), callbacks=[timer],
    )  # fmt: skip
    start = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - start
    trainer.save_model(str(args.output_dir / "final"))
    args.result.parent.mkdir(parents=True, exist_ok=True)
    result = {"seconds": timer.seconds, "train_seconds": train_seconds}
    args.result.write_text(json.dumps(result), encoding="utf-8")
    print(f"TRL GRPO: {len(timer.seconds)} iterations in {train_seconds:.0f} s")


if __name__ == "__main__":
    main()
