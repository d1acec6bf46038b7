"""`rlhf-dist demo --task tool_use --algorithm grpo`: SFT on tool demonstrations, then GRPO
with the `lookup` tool, then both policies evaluated on held-out prompts (docs/agents.md).

The answer to "what is the code of KEY ?" is in a table only the tool sees
(demo/tool_task.py). Half the demonstrations call the tool, half guess, so the SFT policy
is right about 1/2 + 1/12 of the time. summary.json: `sft.gold_reward`,
`grpo.gold_reward` (exact-answer rate on the held-out keys' prompts) and
`*.tool_calls_per_response`.

Measured (docs/agents.md, "The tool-use demo"): gold 0.59 -> 0.83, tool calls per
response 0.45 -> 0.78, about a minute on a quiet 2-core CPU.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from rlhf_dist.config import config_from_dict, validate
from rlhf_dist.demo import task, tool_task
from rlhf_dist.demo.pipeline import _with_output, demo_model, with_overrides

TOOLS = ["rlhf_dist.demo.tool_task:lookup"]
REWARD = "rlhf_dist.demo.tool_task:answer_reward"
GOLD = "rlhf_dist.demo.tool_task:gold_eval"


def tool_stage_configs(root: Path, files: dict, policy: Path, seed: int, quick: bool) -> dict:
    """The config trees of the three stages (numbers tuned for a 2-core CPU)."""
    data = {"max_prompt_length": 32, "max_length": 64}
    gen = {"max_new_tokens": 16, "temperature": 0.7, "tools": TOOLS, "max_turns": 3}
    sft_policy = str(root / "sft" / "final")

    def run(name, every=10):
        return {"output_dir": str(root / name), "seed": seed, "log_every": every}

    return {
        "sft": {
            "run": run("sft"),
            "model": demo_model(policy=str(policy)),
            "data": {**data, "train": str(files["sft"])},
            "sft": {
                "epochs": 2 if quick else 40,
                "batch_size": 16,
                "micro_batch_size": 16,
                "optim": {"lr": 3e-3, "schedule": "cosine", "warmup_steps": 5},
            },
        },
        "grpo": {
            "run": run("grpo", 2),
            "model": demo_model(policy=sft_policy),
            "data": {**data, "train": str(files["prompts"])},
            "generation": gen,
            "reward": {"function": REWARD},
            "ppo": {
                "iterations": 3 if quick else 30,
                "estimator": "grpo",
                "rollout_batch_size": 8,
                "samples_per_prompt": 4,
                "rollout_micro_batch_size": 32,
                "ppo_epochs": 1,
                "minibatch_size": 16,
                "micro_batch_size": 16,
                "optim": {"lr": 3e-4},
                "kl_coef": 0.05,
            },
        },
        "eval": {
            "run": run("eval"),
            "model": demo_model(policy=sft_policy),
            "data": {**data, "train": str(files["eval_prompts"])},
            "generation": gen,
            "reward": {"function": REWARD},
            "eval": {"num_prompts": 64, "gold_function": GOLD},
        },
    }


def run_tool_demo(output_dir: str, seed: int = 0, quick: bool = False, overrides=()) -> dict:
    """SFT -> GRPO with the tool -> eval of both; returns (and writes) DIR/summary.json."""
    from rlhf_dist.distributed import Runtime
    from rlhf_dist.evaluate import run_eval
    from rlhf_dist.models import quiet_transformers
    from rlhf_dist.trainers.ppo import train_ppo
    from rlhf_dist.trainers.sft import train_sft

    quiet_transformers()
    start, root = time.time(), Path(output_dir)
    files = tool_task.write_tool_task(root / "task", seed=seed)
    tokenizer = tool_task.build_tool_tokenizer(root / "task" / "tokenizer")
    policy = task.build_tiny_models(root / "models", tokenizer, size="tiny", seed=seed)["policy"]
    trees = with_overrides(tool_stage_configs(root, files, policy, seed, quick), overrides)
    configs = {name: config_from_dict(tree) for name, tree in trees.items()}
    for name, cfg in configs.items():
        validate(cfg, "ppo" if name == "grpo" else name)
    runtime = Runtime(seed=seed)
    runtime.print(f"== tool-use task written to {root / 'task'}; stage 1/3: SFT")
    train_sft(configs["sft"], runtime)
    runtime.print("== stage 2/3: GRPO with the lookup tool")
    train_ppo(configs["grpo"], runtime)
    runtime.print("== stage 3/3: evaluation of the SFT and GRPO policies on held-out keys")
    sft_eval = run_eval(_with_output(configs["eval"], root / "eval" / "sft"), runtime)
    grpo_cfg = _with_output(
        configs["eval"], root / "eval" / "grpo", policy=str(root / "grpo" / "final")
    )
    grpo_eval = run_eval(grpo_cfg, runtime)

    def pick(ev):
        return {
            "gold_reward": ev["gold_reward"],
            "tool_calls_per_response": ev["tool_calls"],
            "turns": ev["turns"],
        }

    summary = {"sft": pick(sft_eval), "grpo": pick(grpo_eval)}
    summary["wall_seconds"] = round(time.time() - start, 1)
    if runtime.is_main:
        (root / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        s, g = summary["sft"], summary["grpo"]
        runtime.print(
            f"== tool-use demo: gold SFT {s['gold_reward']:.3f} -> GRPO {g['gold_reward']:.3f}; "
            f"tool calls per response {s['tool_calls_per_response']:.2f} -> "
            f"{g['tool_calls_per_response']:.2f}; {summary['wall_seconds']:.0f} s"
        )
    return summary
