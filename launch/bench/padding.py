"""Padding paid by the demo's SFT and RM steps and PPO updates: padded rows, a token
budget, and packed, padding-free sequences (issue #23).

Runs the demo's own SFT and reward-model stages (`rlhf-dist demo`'s configs: batches of
32, one micro-batch of 32 rows) on the demo task, then again with `<stage>.micro_batch_tokens`
set (rows sorted by length, cut by the budget), then with `model.packed_sequences` (alone
and with the first budget). Prints, per setting, the mean `<stage>/pad_fraction` the run
logged (the padded layout's), micro-batches per step, the token slots and real tokens per
whole-sequence forward (what the backbone computed: packed rows have fewer slots) and
seconds per step. With --ppo-iterations N > 0, the demo's PPO stage too (from the SFT
and RM the first runs wrote), N iterations per setting, seconds per update (median over
iterations 2..N).

    python launch/bench/padding.py OUT [--budgets 512,1024] [--epochs 1] [--ppo-iterations 4]
        [--ppo-budget 320] [--attn sdpa]

Run with PYTHONPATH set to the tree to measure. Times on the shared 2-core CPU are noisy;
the pad fraction and the token slots are exact (they depend only on the data and the
split). On CPU, eager/sdpa attend packed rows through a block-diagonal 4-D mask, which
costs time of its own: the seconds say whether packing pays there.
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
    from rlhf_dist.data.batching import BatchPlan, global_batches

    section = getattr(cfg, stage)
    plan = BatchPlan(section.batch_size, 1, section.micro_batch_size, section.micro_batch_tokens)
    batches = list(global_batches(len(widths), section.batch_size, cfg.run.seed, section.epochs))
    counts = [
        len(plan.micro_batches([widths[i] for i in idx], 0, rows_per_item)) for _, idx in batches
    ]
    return sum(counts) / len(counts)


class ForwardSlots:
    """Counts the token slots and real tokens of every whole-sequence forward (the
    inputs `models.backbone_inputs` builds: padded or packed) while active."""

    def __init__(self):
        self.slots = self.real = self.forwards = 0

    def __enter__(self):
        from rlhf_dist.engine import packing as models

        self.original = original = models.backbone_inputs

        def counting(input_ids, attention_mask, layout):
            inputs = original(input_ids, attention_mask, layout)
            self.slots += inputs["input_ids"].numel()
            self.real += int(attention_mask.sum())
            self.forwards += 1
            return inputs

        models.backbone_inputs = counting
        return self

    def __exit__(self, *exc):
        from rlhf_dist.engine import packing as models

        models.backbone_inputs = self.original

    def figures(self) -> dict:
        n = max(self.forwards, 1)
        return {"slots_per_forward": self.slots / n, "real_per_forward": self.real / n}


def setting_tree(tree: dict, out: Path, name: str, section: str, budget: int, packed: bool):
    from rlhf_dist.config import apply_override

    tree = apply_override(tree, f"run.output_dir={out / name}")
    tree = apply_override(tree, f"{section}.micro_batch_tokens={budget}")
    tree = apply_override(tree, f"model.packed_sequences={str(packed).lower()}")
    return apply_override(tree, "run.log_every=1")


def setting_name(stage: str, budget: int, packed: bool) -> str:
    return f"{stage}-{budget or 'rows'}" + ("-packed" if packed else "")


def run_stage(stage: str, tree: dict, out: Path, budget: int, packed: bool, runtime) -> dict:
    from rlhf_dist.config import config_from_dict
    from rlhf_dist.data.rows import load_rows, preference_pairs, sft_examples
    from rlhf_dist.distributed import seed_everything
    from rlhf_dist.models import tokenizer_for
    from rlhf_dist.trainers.reward import train_reward_model
    from rlhf_dist.trainers.sft import train_sft

    name = setting_name(stage, budget, packed)
    cfg = config_from_dict(setting_tree(tree, out, name, stage, budget, packed))
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
    with ForwardSlots() as slots:
        summary = (train_sft if stage == "sft" else train_reward_model)(cfg, runtime)
    seconds = time.perf_counter() - start
    metrics = out / name / "metrics.jsonl"
    return {
        "setting": name,
        "pad_fraction": mean_logged(metrics, f"{stage}/pad_fraction"),
        "micro_batches_per_step": micro_batches_per_step(cfg, stage, widths, rows_per_item),
        **slots.figures(),
        "s_per_step": seconds / summary["steps"],
        "train_loss": summary["train_loss"],
    }


def run_ppo(tree: dict, out: Path, budget: int, packed: bool, iterations: int, runtime) -> dict:
    """The demo's PPO stage for `iterations`; seconds per update (median after the first)."""
    import statistics

    from rlhf_dist.config import apply_override, config_from_dict
    from rlhf_dist.trainers.ppo import train_ppo

    name = setting_name("ppo", budget, packed)
    tree = apply_override(tree, f"ppo.iterations={iterations}")
    cfg = config_from_dict(setting_tree(tree, out, name, "ppo", budget, packed))
    with ForwardSlots() as slots:
        train_ppo(cfg, runtime)
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time/update" in r]
    return {
        "setting": name,
        "pad_fraction": sum(r["update/pad_fraction"] for r in rows) / len(rows),
        "micro_batches_per_step": float("nan"),
        **slots.figures(),
        "s_per_step": statistics.median(r["time/update"] for r in rows[1:] or rows),
        "train_loss": rows[-1]["policy/loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--budgets", default="512,1024")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--ppo-iterations", type=int, default=0)
    parser.add_argument("--ppo-budget", type=int, default=320)
    parser.add_argument("--attn", default="auto", help="model.attn_implementation")
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
    budgets = [int(b) for b in args.budgets.split(",")]
    settings = [(0, False), *((b, False) for b in budgets), (0, True), (budgets[0], True)]
    for stage in ("sft", "rm"):
        tree = apply_override(trees[stage], f"{stage}.epochs={args.epochs}")
        tree = apply_override(tree, f"model.attn_implementation={args.attn}")
        if stage == "rm":  # the RM starts from the SFT policy the first SFT run wrote
            tree = apply_override(tree, f"model.policy={args.out / 'sft-rows' / 'final'}")
        for budget, packed in settings:
            results.append(run_stage(stage, tree, args.out, budget, packed, runtime))
            print(json.dumps(results[-1]), flush=True)
    if args.ppo_iterations:
        tree = apply_override(trees["ppo"], f"model.attn_implementation={args.attn}")
        tree = apply_override(tree, f"model.policy={args.out / 'sft-rows' / 'final'}")
        tree = apply_override(tree, f"model.reward={args.out / 'rm-rows' / 'final'}")
        for budget, packed in ((0, False), (args.ppo_budget, False), (0, True)):
            results.append(run_ppo(tree, args.out, budget, packed, args.ppo_iterations, runtime))
            print(json.dumps(results[-1]), flush=True)
    header = f"{'setting':<18} {'pad_fraction':>12} {'micro/step':>10} {'slots/fwd':>9}"
    print(f"{header} {'real/fwd':>8} {'s/step':>8}")
    for r in results:
        print(
            f"{r['setting']:<18} {r['pad_fraction']:>12.3f} "
            f"{r['micro_batches_per_step']:>10.2f} {r['slots_per_forward']:>9.0f} "
            f"{r['real_per_forward']:>8.0f} {r['s_per_step']:>8.3f}"
        )


if __name__ == "__main__":
    main()
