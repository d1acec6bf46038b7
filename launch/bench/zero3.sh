#!/usr/bin/env bash
# Per-rank model-state memory and generation time, DeepSpeed stage 0 vs ZeRO-3, 2 CPU ranks.
# Usage: bash launch/bench/zero3.sh [--prompts 32 --new-tokens 32 --repeats 3]
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
out=$(mktemp -d)
for stage in 0 3; do
  accelerate launch --config_file "accelerate_configs/cpu_zero${stage}.yaml" \
    launch/bench/zero3_probe.py --out "$out" "$@" > "$out/stage${stage}.log" 2>&1 \
    || { tail -30 "$out/stage${stage}.log"; exit 1; }
done
python launch/bench/zero3_report.py "$out"
