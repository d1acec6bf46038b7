"""Where one `rlhf-dist ppo` iteration of the vs-TRL benchmark spends its time (run in .venv).

Usage: python launch/bench/vs_trl_profile.py PREPARED_DIR [--iterations 4] [--json out.json]
       (PREPARED_DIR from vs_trl_prepare.py, e.g. runs/bench/vs_trl/tiny after vs_trl.sh)

Runs `rlhf-dist ppo` in this process on PREPARED_DIR/ours.yaml with torch.profiler on
the last iteration and splits that iteration's time three ways:
- matrix-product kernels (mm, addmm, bmm, fused attention): the only work the FLOP
  floor counts, compared with the time the floor allows them;
- every other tensor op (elementwise, reductions, copies, indexing, the fused Adam
  kernel), with its call count and mean time per call;
- the rest: Python (transformers' modules, our loop) and the autograd engine.
The profiler adds ~1-2 us per op, so the profiled iteration is slower than a plain one;
both are printed, and the shares are of the profiled one.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from vs_trl_report import flop_floor  # noqa: E402

MATMUL_OPS = {
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
}


def profile_last_iteration(prepared: Path, iterations: int) -> tuple[list, float, list[float]]:
    """(profiler events of the last iteration, its wall seconds, plain iteration times)."""
    import rlhf_dist.trainers.ppo.recipe as ppo
    from rlhf_dist.cli import main

    original, calls, captured = ppo.ppo_iteration, [0], {}

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] < iterations:
            return original(*args, **kwargs)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            result = original(*args, **kwargs)
            captured["wall"] = time.perf_counter() - start
        captured["events"] = prof.key_averages()
        return result

    ppo.ppo_iteration = wrapped
    with tempfile.TemporaryDirectory() as out:
        argv = ["ppo", "--config", str(prepared / "ours.yaml"), f"run.output_dir={out}"]
        argv.append(f"ppo.iterations={iterations}")
        code = main(argv)
        if code:
            raise SystemExit(f"rlhf-dist ppo failed (exit {code})")
        rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").open()]
    plain = [r["time/total"] for r in rows if "time/total" in r][1:-1]  # warm-up, profiled
    return captured["events"], captured["wall"], plain


def split_time(events) -> dict:
    """Self CPU seconds and call counts of matmul kernels and of all other aten ops."""
    out = {"matmul_s": 0.0, "matmul_calls": 0, "other_s": 0.0, "other_calls": 0, "top": []}
    for e in events:
        if not e.key.startswith("aten::"):
            continue  # autograd-engine and optimizer wrappers: their self time is Python/C++ glue
        kind = "matmul" if e.key in MATMUL_OPS else "other"
        out[f"{kind}_s"] += e.self_cpu_time_total / 1e6
        out[f"{kind}_calls"] += e.count
        out["top"].append((e.self_cpu_time_total / 1e6, e.count, e.key))
    out["top"] = sorted(out["top"], reverse=True)[:12]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prepared", type=Path)
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    events, wall, plain = profile_last_iteration(args.prepared, args.iterations)
    s = split_time(events)
    floor = flop_floor(args.prepared)
    rest = wall - s["matmul_s"] - s["other_s"]
    median_plain = sorted(plain)[len(plain) // 2] if plain else float("nan")
    print(f"== one PPO iteration: {median_plain * 1e3:.0f} ms plain, {wall * 1e3:.0f} ms profiled")
    for name, secs, calls in (
        ("matrix products", s["matmul_s"], s["matmul_calls"]),
        ("other tensor ops", s["other_s"], s["other_calls"]),
    ):
        print(
            f"   {name:17s} {secs * 1e3:6.0f} ms ({secs / wall:4.0%}) in {calls} calls, "
            f"{secs / max(calls, 1) * 1e6:.1f} us each"
        )
    print(f"   {'Python + autograd':17s} {rest * 1e3:6.0f} ms ({rest / wall:4.0%})")
    print(
        f"   FLOP floor {floor['floor_s'] * 1e3:.1f} ms: the matrix products ran at "
        f"{floor['flops_total'] / s['matmul_s'] / 1e9:.0f} GFLOP/s "
        f"(model-shape rate {floor['matmul_rate'] / 1e9:.0f} GFLOP/s)"
    )
    print("   largest ops (self ms, calls):")
    for secs, calls, key in s["top"]:
        print(f"     {secs * 1e3:7.1f} {calls:6d}  {key}")
    if args.json:
        result = {"wall_profiled_s": wall, "plain_s": plain, "floor": floor, **s}
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
