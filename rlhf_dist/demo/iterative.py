"""`rlhf-dist demo --algorithm iterative`: SFT once on the demo task, then two rounds of
iterative RLHF (rlhf_dist/iterative.py) labelled by the task's gold reward with the
Bradley-Terry noise of its preference data. Figures: docs/iterate.md."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

from rlhf_dist.config import config_from_dict, validate
from rlhf_dist.demo import task
from rlhf_dist.demo.pipeline import (
    GOLD,
    demo_model,
    rl_section,
    stage_configs,
    task_and_models,
    with_overrides,
)


def iterate_tree(root: Path, trees: dict, files: task.TaskFiles, seed: int, quick: bool) -> dict:
    """The iterate config of the demo: the SFT policy, the demo's RM and PPO sections with
    shorter PPO per round, and the gold labeller. Sizes tuned for a 2-core CPU."""
    ppo = rl_section("ppo", 0.1 if quick else 1.0) | {"iterations": 4 if quick else 16}
    meta = json.loads((files.root / "task.json").read_text())
    return {
        "run": {"output_dir": str(root / "iterate"), "seed": seed, "log_every": 2},
        "model": demo_model(policy=str(root / "sft" / "final")),
        "data": {
            **trees["rm"]["data"],
            "train": str(files.prompts),
            "eval": str(files.eval_prompts),
        },
        "rm": trees["rm"]["rm"],
        "ppo": ppo,
        "generation": trees["ppo"]["generation"],
        "reward": trees["ppo"]["reward"],
        "eval": {**trees["eval"]["eval"], "gold_function": GOLD},
        "iterate": {
            "rounds": 2,
            "labeller": "gold",
            "label_beta": meta["beta"],
            "pairs_per_round": 128 if quick else 384,
            "heldout_pairs": 64 if quick else 256,
        },
    }


def run_iterative_demo(
    output_dir: str, seed: int = 0, quick: bool = False, overrides: Sequence[str] = ()
) -> dict:
    """SFT -> iterate (2 rounds); returns (and writes) DIR/iterate/summary.json with the
    demo's wall time added."""
    from rlhf_dist.distributed import Runtime
    from rlhf_dist.iterative import run_iterate
    from rlhf_dist.models import quiet_transformers
    from rlhf_dist.trainers.sft import train_sft

    quiet_transformers()
    start, root = time.time(), Path(output_dir)
    files, models = task_and_models(root, seed)
    trees = stage_configs(root, files, models, seed, quick)
    trees["iterate"] = iterate_tree(root, trees, files, seed, quick)
    trees = with_overrides({k: trees[k] for k in ("sft", "iterate")}, overrides)
    configs = {name: config_from_dict(tree) for name, tree in trees.items()}
    validate(configs["sft"], "sft")
    validate(configs["iterate"], "iterate")
    runtime = Runtime(seed=seed)
    runtime.print(f"== demo task written to {files.root}; SFT, then 2 rounds of iterative RLHF")
    train_sft(configs["sft"], runtime)
    summary = run_iterate(configs["iterate"], runtime)
    summary["demo_wall_seconds"] = round(time.time() - start, 1)
    rounds = summary["rounds"]
    if runtime.is_main and len(rounds) >= 2:
        first, second = rounds[0], rounds[1]
        runtime.print(
            f"\n== iterative demo: RM1 on pi1's pairs {first['rm_accuracy_on_this_policy']:.3f}"
            f" -> RM2 on pi1's pairs {second['rm_accuracy_on_previous_policy']:.3f}; gold "
            f"pi1 {first['gold_reward']:.3f} -> pi2 {second['gold_reward']:.3f}; "
            f"{summary['demo_wall_seconds']:.0f} s\n   summary: {root / 'iterate' / 'summary.json'}"
        )
    return summary
