"""The table of launch/bench/vs_trl_arithmetic.sh: per seed, held-out accuracy (greedy, the
demo's evaluation) before -> after GRPO for ours and TRL's, and each training loop's time.

Usage: python launch/bench/vs_trl_arithmetic_report.py OUT_DIR SEED [SEED ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def seed_row(out: Path, seed: int) -> dict:
    d = out / f"seed{seed}"
    ours = json.loads((d / "ours" / "summary.json").read_text())
    trl = json.loads((d / "trl.json").read_text())
    trl_eval = json.loads((d / "eval" / "summary.json").read_text())
    return {
        "seed": seed,
        "base": ours["base"]["accuracy"],
        "ours": ours["grpo"]["accuracy"],
        "trl": trl_eval["score"],
        "ours_s": ours["seconds"]["grpo"],
        "trl_s": trl["train_seconds"],
        "ours_it": ours["seconds_per_iteration"],
        "trl_it": statistics.median(trl["seconds"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("seeds", type=int, nargs="+")
    args = ap.parse_args()
    rows = [seed_row(args.out, s) for s in args.seeds]
    print("held-out accuracy (greedy, last number right) and GRPO training time")
    print(
        "seed | base | ours after (gain) | TRL after (gain) | ours s (s/it) | TRL s (s/it) | ours/TRL time"
    )
    for r in rows:
        print(
            f"{r['seed']:4d} | {r['base']:.3f} | {r['ours']:.3f} ({r['ours'] - r['base']:+.3f}) | "
            f"{r['trl']:.3f} ({r['trl'] - r['base']:+.3f}) | {r['ours_s']:.0f} ({r['ours_it']:.1f}) | "
            f"{r['trl_s']:.0f} ({r['trl_it']:.1f}) | {r['ours_s'] / r['trl_s']:.2f}x"
        )
    gain = {k: statistics.mean(r[k] - r["base"] for r in rows) for k in ("ours", "trl")}
    ratio = statistics.mean(r["ours_s"] / r["trl_s"] for r in rows)
    print(
        f"mean gain: ours {gain['ours']:+.3f}, TRL {gain['trl']:+.3f}; time ours/TRL {ratio:.2f}x"
    )
    (args.out / "summary.json").write_text(json.dumps({"rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
