"""Padding paid by the demo's SFT and RM steps, with and without a token budget (issue #23).

Runs the demo's own SFT and reward-model stages (`rlhf-dist demo`'s configs: batches of
32, one micro-batch of 32 rows) on the demo task, then again with `<stage>.micro_batch_tokens`
set (rows sorted by length, cut by the budget). Prints, per setting, the mean
`<stage>/pad_fraction` the run logged, micro-batches per step and seconds per step.

    python launch/bench/padding.py OUT [--budgets 512,1024] [--epochs 1]

Run with PYTHONPATH set to the tree to measure. Times on the shared 2-core CPU are noisy;
the pad fraction is the figure this measures (it depends only on the data and the split).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def mean_logged(path: Path, name: str) -> float:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    values = [r[name] for r in rows if name in r]
    return sum(values) / len(values)


def micro_batches_per_step(cfg, stage: str, widths: list[int], rows_per_item: int) -> float:
    """Mean micro-batches per optimizer step of one rank over the run's global batches."""
    from rlhf_dist.batching import BatchPlan, global_batches

    section = getattr(cfg, stage)
    plan = BatchPlan(section.batch_size, 1, section.micro_batch_size, section.micro_batch_tokens)
    batches = list(global_batches(len(widths), section.batch_size, cfg.run.seed, section.epochs))
    counts = [
        len(plan.micro_batches([widths[i] for i in idx], 0, rows_per_item)) for _, idx in batches
    ]
    return sum(counts) / len(counts)


def run_stage(stage: str, tree: dict, out: Path, budget: int, runtime) -> dict:
    from rlhf_dist.config import apply_override, config_from_dict
    from rlhf_dist.data import load_rows, preference_pairs, sft_examples
    from rlhf_dist.distributed import seed_everything
    from rlhf_dist.models import tokenizer_for
    from rlhf_dist.trainers.reward import train_reward_model
    from rlhf_dist.trainers.sft import train_sft

    name = f"{stage}-{budget or 'rows'}"
    tree = apply_override(tree, f"run.output_dir={out / name}")
    tree = apply_override(tree, f"{stage}.micro_batch_tokens={budget}")
    tree = apply_override(tree, "run.log_every=1")
    cfg = config_from_dict(tree)
    tokenizer = tokenizer_for(cfg, "policy")
    rows = load_rows(cfg.data.train, "data.train")
    if stage == "sft":
        widths = [len(ex.ids) for ex in sft_examples(rows, tokenizer, cfg.data)[0]]
        rows_per_item = 1
    else:
        pairs = preference_pairs(rows, tokenizer, cfg.data)[0]
        widths, rows_per_item = [max(len(p.chosen), len(p.rejected)) for p in pairs], 2
    seed_everything(cfg.run.seed)  # the RM's new head: the same init in every setting
    start = time.perf_counter()
    summary = (train_sft if stage == "sft" else train_reward_model)(cfg, runtime)
    seconds = time.perf_counter() - start
    metrics = out / name / "metrics.jsonl"
    return {
        "setting": name,
        "pad_fraction": mean_logged(metrics, f"{stage}/pad_fraction"),
        "micro_batches_per_step": micro_batches_per_step(cfg, stage, widths, rows_per_item),
        "s_per_step": seconds / summary["steps"],
        "train_loss": summary["train_loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--budgets", default="512,1024")
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()

    from rlhf_dist.config import apply_override
    from rlhf_dist.demo import task
    from rlhf_dist.demo.pipeline import stage_configs
    from rlhf_dist.distributed import Runtime
    from rlhf_dist.models import quiet_transformers

    quiet_transformers()
    files = task.write_task(args.out / "task", seed=0)
    tokenizer = task.build_tokenizer(files.tokenizer_dir)
    models = task.build_tiny_models(args.out / "models", tokenizer, size="tiny", seed=0)
    trees = stage_configs(args.out, files, models, 0, quick=False)
    runtime = Runtime(seed=0)
    results = []
    for stage in ("sft", "rm"):
        tree = apply_override(trees[stage], f"{stage}.epochs={args.epochs}")
        if stage == "rm":  # the RM starts from the SFT policy the first SFT run wrote
            tree = apply_override(tree, f"model.policy={args.out / 'sft-rows' / 'final'}")
        for budget in [0] + [int(b) for b in args.budgets.split(",")]:
            results.append(run_stage(stage, tree, args.out, budget, runtime))
            print(json.dumps(results[-1]), flush=True)
    print(f"{'setting':<12} {'pad_fraction':>12} {'micro/step':>10} {'s/step':>8}")
    for r in results:
        print(
            f"{r['setting']:<12} {r['pad_fraction']:>12.3f} "
            f"{r['micro_batches_per_step']:>10.2f} {r['s_per_step']:>8.3f}"
        )


if __name__ == "__main__":
    main()
