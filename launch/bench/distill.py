"""On-policy distillation against GRPO on the offline demo (docs/distill.md).

1. The demo (`rlhf-dist demo`, seed SEED): SFT -> reward model -> PPO -> held-out gold of
   the SFT and PPO policies, in OUT/demo (reused when OUT/demo/summary.json exists).
2. From the SAME SFT policy, for the same number of iterations and 64 sequences per
   iteration each: on-policy distillation (ppo.estimator=distill, model.teacher = the
   demo's PPO policy, no reward model, no reference) and the demo's GRPO (16 prompts x 4
   samples, the demo's reward model); the held-out gold reward after every iteration
   (run.eval_every=1, eval.gold_function, the demo's 128 held-out prompts).
3. A table (every 5th iteration) and a plot: written into docs/distill.md between its
   bench markers and to docs/img/distill_gold.png, and printed, with the criterion: the
   student's final gold >= 90% of the teacher's.

Usage: python launch/bench/distill.py [--out runs/bench/distill] [--seed 0] [--docs docs]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rlhf_dist.config import config_from_dict, validate
from rlhf_dist.demo import pipeline, task
from rlhf_dist.distributed import Runtime
from rlhf_dist.models import quiet_transformers
from rlhf_dist.trainers.ppo import train_ppo

MARK_START, MARK_END = "<!-- bench:distill:start -->", "<!-- bench:distill:end -->"
TABLE_EVERY = 5  # iterations between table rows (the plot has every one)


def demo_files(root: Path, seed: int):
    """The demo's task files (written again, deterministically, to find their paths)."""
    files = task.write_task(root / "task", seed=seed)
    return files


def run_config(demo: Path, files, seed: int, name: str, out: Path) -> dict:
    """The config tree of one arm: the demo's GRPO stage (pipeline.stage_configs), or the
    same with distillation from the demo's PPO policy in place of the reward model."""
    models = {"policy": demo / "models" / "policy"}
    tree = pipeline.stage_configs(demo, files, models, seed, False, "grpo")["grpo"]
    tree["run"] |= {"output_dir": str(out), "log_every": 5, "eval_every": 1}
    tree["data"]["eval"] = str(files.eval_prompts)
    tree["eval"] = {"num_prompts": 128, "gold_function": pipeline.GOLD}
    if name == "distill":
        tree["model"] = pipeline.demo_model(
            policy=str(demo / "sft" / "final"), teacher=str(demo / "ppo" / "final")
        )
        ppo = pipeline.rl_section("ppo", 1.0)  # 64 prompts x 1 sample, the demo's update
        ppo.pop("critic_optim")
        tree["ppo"] = ppo | {"estimator": "distill", "kl_coef": 0.0}
    return tree


def gold_curve(out: Path) -> list[float]:
    """eval/gold_reward after iterations 1..N (metrics.jsonl)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["eval/gold_reward"] for r in rows if "eval/gold_reward" in r]


def table(sft: float, teacher: float, curves: dict, walls: dict) -> str:
    n = len(next(iter(curves.values())))
    rows = ["| iteration | distill | GRPO |", "| --- | --- | --- |"]
    rows.append(f"| 0 (SFT) | {sft:.3f} | {sft:.3f} |")
    for it in [*range(TABLE_EVERY, n, TABLE_EVERY), n]:
        rows.append(f"| {it} | {curves['distill'][it - 1]:.3f} | {curves['grpo'][it - 1]:.3f} |")
    best = {k: max(v) for k, v in curves.items()}
    rows.append(f"| best | {best['distill']:.3f} | {best['grpo']:.3f} |")
    rows.append(f"| wall s | {walls['distill']:.0f} | {walls['grpo']:.0f} |")
    final = curves["distill"][-1]
    first = {
        k: next((i + 1 for i, g in enumerate(v) if g >= 0.9 * teacher), None)
        for k, v in curves.items()
    }
    return "\n".join(rows) + (
        f"\n\nTeacher (the demo's PPO policy): {teacher:.3f}. Student after {n} iterations: "
        f"{final:.3f} = {final / teacher:.1%} of the teacher's gold (criterion: >= 90%). "
        f"First iteration at >= 90% of the teacher's gold: distillation {first['distill']}, "
        f"GRPO {first['grpo']}."
    )


def plot(path: Path, sft: float, teacher: float, curves: dict) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 3.6), dpi=100)
    ax = fig.add_subplot()
    for name, label in (("distill", "on-policy distillation"), ("grpo", "GRPO (reward model)")):
        ys = [sft, *curves[name]]
        ax.plot(range(len(ys)), ys, label=label)
    ax.axhline(teacher, color="gray", linestyle="--", label="teacher (PPO)")
    ax.axhline(0.9 * teacher, color="gray", linestyle=":", label="90% of the teacher")
    ax.set_xlabel("iteration (64 sequences each)")
    ax.set_ylabel("held-out gold reward")
    ax.set_title("Demo: from the SFT policy, distillation vs GRPO")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig).print_png(str(path))


def into_doc(doc: Path, text: str) -> None:
    """Replace what stands between the bench markers of `doc` with `text`."""
    body = doc.read_text(encoding="utf-8")
    head, rest = body.split(MARK_START, 1)
    _, tail = rest.split(MARK_END, 1)
    doc.write_text(f"{head}{MARK_START}\n{text}\n{MARK_END}{tail}", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/bench/distill")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--docs", default="docs", help="where distill.md and img/ are")
    args = parser.parse_args()
    quiet_transformers()
    root, seed = Path(args.out), args.seed
    demo = root / "demo"
    if not (demo / "summary.json").exists():
        pipeline.run_demo(str(demo), seed=seed, algorithm="ppo")
    summary = json.loads((demo / "summary.json").read_text())
    sft, teacher = summary["sft"]["gold_reward"], summary["ppo"]["gold_reward"]
    files = demo_files(demo, seed)
    runtime = Runtime(seed=seed)
    curves, walls = {}, {}
    for name in ("distill", "grpo"):
        cfg = config_from_dict(run_config(demo, files, seed, name, root / name))
        validate(cfg, "ppo")
        start = time.time()
        train_ppo(cfg, runtime)
        walls[name] = time.time() - start
        curves[name] = gold_curve(root / name)
        print(f"== {name}: gold per iteration {[round(g, 3) for g in curves[name]]}", flush=True)
    text = table(sft, teacher, curves, walls)
    print(text)
    docs = Path(args.docs)
    plot(docs / "img" / "distill_gold.png", sft, teacher, curves)
    into_doc(docs / "distill.md", text)
    (root / "curves.json").write_text(
        json.dumps({"sft": sft, "teacher": teacher, "curves": curves, "walls": walls}, indent=1)
    )


if __name__ == "__main__":
    main()
