"""TRL's GRPOTrainer on the GRPO benchmark's shared inputs (run in .venv-trl-grpo).

Usage: python launch/bench/vs_trl_grpo_trl.py PREPARED_DIR RESULT_JSON --output-dir DIR [--vllm]

PREPARED_DIR is what vs_trl_grpo_prepare.py wrote; its settings.json gives every number.
Writes {"seconds": [per iteration]} to RESULT_JSON. An iteration is timed from the end of
the previous one (or the start of training) to TRL's `on_step_end` callback: generation,
reward, reference pass, the one optimizer step, metrics and logging, everything TRL's loop
does per rollout (ours: `time/total`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from datasets import Dataset
from datasets.table import InMemoryTable
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_reward import trl_reward  # noqa: E402
from trl_timer import IterationTimer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prepared", type=Path)
    ap.add_argument("result", type=Path)
    ap.add_argument("--output-dir", type=Path, required=True)
    # TRL's vLLM colocate mode (one engine in the training process; GPUs only).
    ap.add_argument("--vllm", action="store_true")
    args = ap.parse_args()
    s = json.loads((args.prepared / "settings.json").read_text(encoding="utf-8"))
    torch.set_num_threads(s["threads"])
    rows = s["prompts_per_iteration"] * s["samples_per_prompt"]
    lines = (args.prepared / "prompts.jsonl").read_text(encoding="utf-8").splitlines()
    # A fixed fingerprint: datasets otherwise hashes the Arrow table with dill, which on
    # the first GPU loan's image (Python 3.12, pyarrow 24) failed ("Can't pickle
    # MonthDayNano"); the prompts are the same either way.
    table = InMemoryTable.from_pylist([json.loads(line) for line in lines])
    dataset = Dataset(table, fingerprint="vs-trl-grpo-prompts")
    policy = str(args.prepared / "policy")
    config = GRPOConfig(
        # bf16: fp32 weights under bf16 autocast (TRL's mixed precision), as ours does
        # with model.dtype=bfloat16 without DeepSpeed (fp32 masters).
        output_dir=str(args.output_dir), use_cpu=not torch.cuda.is_available(),
        bf16=s.get("dtype") == "bfloat16", seed=0,
        # TRL's configs default to gradient checkpointing (a second forward in the backward);
        # off, as ours runs. The figures in docs/benchmarks.md up to 2026-12-03 had it on.
        gradient_checkpointing=False,
        per_device_train_batch_size=rows, gradient_accumulation_steps=1,
        num_generations=s["samples_per_prompt"], num_iterations=1,
        max_completion_length=s["new_tokens"],
        generation_kwargs={"min_new_tokens": s["new_tokens"]},
        temperature=s["temperature"], top_k=0, top_p=1.0,
        beta=s["kl_coef"], loss_type="dapo", learning_rate=s["lr"],
        lr_scheduler_type="constant", max_steps=s["iterations"], logging_steps=1,
        report_to=[], save_strategy="no", log_completions=False, dataloader_num_workers=0,
        use_vllm=args.vllm, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3,
    )  # fmt: skip
    timer = IterationTimer()
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32),
        reward_funcs=[trl_reward], args=config, train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(policy), callbacks=[timer],
    )  # fmt: skip
    trainer.train()
    args.result.parent.mkdir(parents=True, exist_ok=True)
    args.result.write_text(json.dumps({"seconds": timer.seconds}), encoding="utf-8")
    print("TRL GRPO seconds per iteration:", [round(x, 2) for x in timer.seconds])


if __name__ == "__main__":
    main()
