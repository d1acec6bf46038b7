"""2-rank ZeRO-3 equals one process, for the tiny fused-expert MoE families (docs/moe.md).

For each family of tests/moe_models.py (qwen3_moe, mixtral, olmoe) and each stage (sft,
dpo, grpo), runs the stage in one process and under `accelerate launch` with
accelerate_configs/cpu_zero3.yaml on 2 ranks (fp32, gloo), then compares every
non-timing metric of the two metrics.jsonl files (but the layout statistic LAYOUT),
row by row, to 1e-5 (absolute, or relative above 1). GRPO decodes greedily (generation.top_k=1), so a rank samples what the
one process samples for the same prompts; its groups are then identical (advantages 0)
and the entropy bonus is what moves the weights. Last, GRPO with ppo.routing_replay=r2 on
qwen3_moe. Prints a table and a last line `moe_parity: ok N/N` or the failures.

    python tests/distributed/scripts/moe_parity.py [--only qwen3_moe:grpo ...] [--keep DIR]

The one-process and 2-rank runs of a combination start together; combinations run one
after another. Exit status 0 only when every combination agrees."""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
TOL = 1e-5
FAMILIES = ("qwen3_moe", "mixtral", "olmoe")
STAGES = ("sft", "dpo", "grpo")
# wall-clock, rate and memory metrics (a measured peak, or the plan of one rank's share)
# differ between the runs by nature; every other metric must agree
TIMING = ("time/", "throughput/", "memory/")
# the padding share of the update's micro-batches: each rank shuffles its own rows into
# its micro-batches (ppo_update's randperm), and a micro-batch is trimmed to its longest
# row, so which rows share a micro-batch, and the padding, depends on the world size; the
# losses do not (each micro-batch's sum over the global count)
LAYOUT = ("update/pad_fraction",)


def build_assets(root: Path) -> dict[str, Path]:
    """The demo task's files (2 steps of each stage) and a tiny model of each family."""
    sys.path.insert(0, str(REPO / "tests"))
    from moe_models import tiny_moe

    from rlhf_dist.demo import task
    from rlhf_dist.models import quiet_transformers

    quiet_transformers()
    files = task.write_task(root / "task", seed=0, n_sft=16, n_pref=16, n_pref_eval=8,
                            n_prompts=8, n_eval_prompts=4)  # fmt: skip
    tokenizer = task.build_tokenizer(files.tokenizer_dir)
    paths = {f: Path(tiny_moe(f, tokenizer, root / "models")) for f in FAMILIES}
    return {"sft": files.sft, "prefs": files.prefs_train, "prompts": files.prompts, **paths}


def stage_args(stage: str, policy: Path, assets: dict[str, Path]) -> list[str]:
    """`python -m rlhf_dist STAGE ...` arguments: 2 optimizer steps of 8 rows (or 4
    prompts x 2 samples), micro-batches of 2, fp32."""
    common = [f"model.policy={policy}", "run.log_every=1",
              "perf.num_threads=1", "model.router_aux_loss_coef=0.05"]  # fmt: skip
    if stage == "sft":
        return ["sft", *common, f"data.train={assets['sft']}", "sft.batch_size=8",
                "sft.micro_batch_size=2", "sft.optim.lr=3e-3"]  # fmt: skip
    if stage == "dpo":
        return ["dpo", *common, f"data.train={assets['prefs']}", "dpo.batch_size=8",
                "dpo.micro_batch_size=2", "dpo.optim.lr=3e-3"]  # fmt: skip
    return ["grpo", *common, f"data.train={assets['prompts']}",
            "reward.function=rlhf_dist.demo.task:gold_reward_fn", "ppo.iterations=2",
            "ppo.rollout_batch_size=4", "ppo.samples_per_prompt=2",
            "ppo.rollout_micro_batch_size=4", "ppo.minibatch_size=8", "ppo.micro_batch_size=2",
            "ppo.optim.lr=1e-2", "ppo.entropy_coef=0.1", "generation.max_new_tokens=6",
            "generation.top_k=1"]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pair(args: list[str], work: Path, timeout: float) -> tuple[int, str]:
    """Run `args` (with run.output_dir=work/one and work/two appended) in one process and
    on 2 ZeRO-3 ranks at once; (worst return code, output tails on failure)."""
    env = dict(os.environ, PYTHONPATH=f"{REPO}:{REPO / 'tests'}", OMP_NUM_THREADS="1")
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
              str(REPO / "accelerate_configs/cpu_zero3.yaml"), "--main_process_port",
              str(free_port())]  # fmt: skip
    commands = {
        "one": [sys.executable, "-m", "rlhf_dist", *args, f"run.output_dir={work / 'one'}"],
        "two": [*launch, "-m", "rlhf_dist", *args, f"run.output_dir={work / 'two'}"],
    }
    procs = {}
    for name, command in commands.items():
        with (work / f"{name}.log").open("w") as log:
            procs[name] = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=log)
    deadline = time.monotonic() + timeout
    codes = {}
    for name, proc in procs.items():
        try:
            codes[name] = proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
        except subprocess.TimeoutExpired:
            proc.kill()  # the launcher; its workers end with their broken collectives
            codes[name] = -9
    tails = "".join(f"--- {n} exited {c}\n{(work / f'{n}.log').read_text()[-3000:]}"
                    for n, c in codes.items() if c != 0)  # fmt: skip
    return max(codes.values(), key=abs), tails


def gap(x: object, y: object) -> float:
    """The gap between two logged values: relative above 1 in size, absolute below; 0 or
    inf for anything that is not a finite number (equal or not)."""
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (x, y))
    if not numbers or not math.isfinite(x) or not math.isfinite(y):
        return 0.0 if x == y else math.inf
    return abs(x - y) / max(1.0, abs(x))


def compare(one: Path, two: Path) -> tuple[int, float, list[str]]:
    """(metrics compared, max gap, mismatches) of two metrics.jsonl files, row by row:
    the same rows, and every non-timing value of the one-process row within TOL."""
    rows = [[json.loads(x) for x in p.read_text().splitlines() if x] for p in (one, two)]
    if len(rows[0]) != len(rows[1]) or not rows[0]:
        return 0, math.inf, [f"rows: {len(rows[0])} vs {len(rows[1])}"]
    count, worst, bad = 0, 0.0, []
    for a, b in zip(*rows):
        for k in (k for k in a if not k.startswith(TIMING) and k not in LAYOUT):
            count += 1
            worst = max(worst, diff := gap(a[k], b.get(k)))
            if diff > TOL:
                bad.append(f"step {a.get('step')} {k}: {a[k]!r} vs {b.get(k)!r}")
    return count, worst, bad


def run_combo(
    family: str, stage: str, replay: str, assets: dict[str, Path], root: Path, timeout: float
) -> tuple[tuple[str, int, float, float], str]:
    """One combination's table row (name, metrics compared, max gap, seconds) and its
    failure ("" when the runs agree)."""
    name = f"{family}:{stage}" + (f":{replay}" if replay else "")
    work = root / name.replace(":", "_")
    work.mkdir(parents=True, exist_ok=True)
    args = stage_args(stage, assets[family], assets)
    args += [f"ppo.routing_replay={replay}"] if replay else []
    start = time.monotonic()
    code, tails = run_pair(args, work, timeout)
    if code != 0:
        return (name, 0, math.inf, time.monotonic() - start), f"{name}: exited {code}\n{tails}"
    count, worst, bad = compare(work / "one/metrics.jsonl", work / "two/metrics.jsonl")
    print(f"{name}: {count} metrics, max gap {worst:.1e}", flush=True)
    failure = f"{name}: " + "; ".join(bad[:10]) if bad else ""
    return (name, count, worst, time.monotonic() - start), failure


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, help="family:stage[:r2] combinations")
    parser.add_argument("--keep", type=Path, default=None, help="work directory to keep")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per combination")
    opts = parser.parse_args()
    combos = [(f, s, "") for f in FAMILIES for s in STAGES] + [("qwen3_moe", "grpo", "r2")]
    if opts.only:
        combos = [c for c in combos if ":".join(x for x in c if x) in opts.only]
    root = opts.keep or Path(tempfile.mkdtemp(prefix="moe_parity_"))
    assets = build_assets(root)
    table, failures = [], []
    for combo in combos:
        row, failure = run_combo(*combo, assets, root, opts.timeout)
        table.append(row)
        failures += [failure] if failure else []
    print("\n| family | stage | metrics compared | max gap | seconds |")
    print("| --- | --- | --- | --- | --- |")
    for name, count, worst, secs in table:
        family, stage = name.split(":", 1)
        print(f"| {family} | {stage} | {count} | {worst:.1e} | {secs:.0f} |")
    print("\n".join(failures))
    ok = len(combos) - len(failures)
    print(f"moe_parity: {'ok' if not failures else 'FAILED'} {ok}/{len(combos)}")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
