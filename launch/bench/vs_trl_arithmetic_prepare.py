"""Shared inputs of the arithmetic-demo comparison with TRL's GRPOTrainer (project's .venv).

Usage: python launch/bench/vs_trl_arithmetic_prepare.py OUT_DIR [--quick]

Writes, from `rlhf-dist demo --task arithmetic`'s own settings (demo/arithmetic_demo.py):
OUT_DIR/train.jsonl (the rows GRPO trains on, in order: chat-message prompts and the
`answer` column the `last_number` reward reads), OUT_DIR/settings.json (the numbers TRL's
side uses: prompts and samples per iteration, iterations, new tokens, temperature, lr,
the policy's directory) and OUT_DIR/eval.json (the demo's held-out evaluation config, which
scores TRL's trained policy exactly as the demo scores its own).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rlhf_dist.config import config_from_dict, to_dict
from rlhf_dist.data.tasks import task_rows
from rlhf_dist.demo import arithmetic_demo as demo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--quick", action="store_true", help="the demo's --quick sizes")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    policy = demo.real_policy()
    trees = demo.arithmetic_stage_configs(args.out / "ours", policy, 0, args.quick)
    grpo, ev = trees["grpo"], trees["eval"]
    rows = task_rows(grpo["data"]["train"], "data.train")
    with (args.out / "train.jsonl").open("w", encoding="utf-8") as f:
        f.writelines(
            json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n" for r in rows
        )
    ppo, gen = grpo["ppo"], grpo["generation"]
    settings = {
        "policy": str(policy),
        "prompts_per_iteration": ppo["rollout_batch_size"],
        "samples_per_prompt": ppo["samples_per_prompt"],
        "iterations": ppo["iterations"],
        "micro_batch_size": ppo["micro_batch_size"],
        "new_tokens": gen["max_new_tokens"],
        "temperature": gen["temperature"],
        "lr": ppo["optim"]["lr"],
        "kl_coef": ppo["kl_coef"],
        "threads": 2,
    }
    (args.out / "settings.json").write_text(json.dumps(settings, indent=1), encoding="utf-8")
    (args.out / "eval.json").write_text(
        json.dumps(to_dict(config_from_dict(ev)), indent=1), encoding="utf-8"
    )
    print(f"prepared {len(rows)} training rows in {args.out}")


if __name__ == "__main__":
    main()
