#!/usr/bin/env bash
# Every alignment algorithm on the offline demo (seed 0; the objective presets gspo, cispo
# and dapo included: demo/pipeline.py ALGORITHMS), one after the other, then one
# table: gold reward of SFT and of the aligned policy, KL to the SFT policy, wall time.
# Usage: [ALGORITHMS="ppo grpo ..."] [SEED=0] bash launch/bench/algorithms.sh [OUT_DIR]
# Run it on a quiet machine: the wall times are the figures in README's table.
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
OUT=${1:-runs/bench/algorithms}
SEED=${SEED:-0}
mkdir -p "$OUT"
ALGORITHMS=${ALGORITHMS:-$(python -c "from rlhf_dist.demo.pipeline import ALGORITHMS; print(*ALGORITHMS)")}
for name in $ALGORITHMS; do
  rm -rf "$OUT/$name"
  rlhf-dist demo --algorithm "$name" --seed "$SEED" --output-dir "$OUT/$name" > "$OUT/$name.log" 2>&1 \
    || { echo "$name failed: see $OUT/$name.log"; exit 1; }
  echo "$name done"
done
python - "$OUT" $ALGORITHMS <<'PY'
import json, sys
from pathlib import Path

out, names = Path(sys.argv[1]), sys.argv[2:]
print("| algorithm | SFT gold | gold | gain | KL to SFT | wall s |")
print("|---|---|---|---|---|---|")
for name in names:
    s = json.loads((out / name / "summary.json").read_text())
    sft, a = s["sft"]["gold_reward"], s[name]["gold_reward"]
    print(f"| {name} | {sft:.3f} | {a:.3f} | {a - sft:+.3f} | {s[name]['kl_to_ref']:.2f} | {s['wall_seconds']:.0f} |")
PY
