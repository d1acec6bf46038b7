#!/usr/bin/env bash
# rlhf_dist vs TRL 1.10.0 PPO: seconds per PPO iteration on the same tiny random-init Llama,
# prompts, batch (32), response length (32), 4 epochs x 4 minibatches, fp32.
# A benchmark, not a test: nothing here is run by launch/test.sh or CI.
#
# Usage: bash launch/bench/vs_trl.sh [ROUNDS=3] [ITERATIONS=6] [SIZE=tiny|small] [PRECISION=fp32|bf16]
#   e.g. ROUNDS=2 SIZE=small bash launch/bench/vs_trl.sh
#   PRECISION=bf16: ours with bf16 weights, TRL with its default bf16 autocast.
#   OURS_PRECISION / TRL_PRECISION set one side each (default PRECISION), e.g. each at its
#   fastest setting on a CPU without AMX: OURS_PRECISION=fp32 TRL_PRECISION=bf16.
# Output: a table of medians, the ratio, the FLOP floor and fairness notes; raw numbers in
# runs/bench/vs_trl/<size>-<ours precision>-vs-<TRL precision>/results/ (summary.json).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${ROUNDS:-3}
ITERATIONS=${ITERATIONS:-6}
SIZE=${SIZE:-tiny}
PRECISION=${PRECISION:-fp32}
OURS_PRECISION=${OURS_PRECISION:-$PRECISION}
TRL_PRECISION=${TRL_PRECISION:-$PRECISION}
OUT=runs/bench/vs_trl/$SIZE-$OURS_PRECISION-vs-$TRL_PRECISION
RESULTS=$OUT/results

[ -x .venv/bin/python ] || bash launch/setup.sh

# TRL lives in its own venv so that it can never change the project's dependencies.
# torch first, pinned to the project's CPU wheel, so that trl's dependency resolution
# finds it satisfied instead of pulling a multi-GB CUDA build. transformers, accelerate
# and datasets are pinned to the project's versions (trl 1.10.0 accepts them: it needs
# transformers>=4.56.2, accelerate>=1.4.0, datasets>=4.7.0) so that both sides run the
# same Llama code.
if [ ! -x .venv-trl/bin/python ] || ! .venv-trl/bin/python -c "import trl" 2>/dev/null; then
  python3 -m venv .venv-trl
  .venv-trl/bin/pip install --quiet torch==2.13.0
  .venv-trl/bin/pip install --quiet trl==1.10.0 transformers==5.24.0 accelerate==1.15.0 \
    datasets==5.2.0
fi

rm -rf "$OUT"
.venv/bin/python launch/bench/vs_trl_prepare.py "$OUT" --size "$SIZE" --iterations "$ITERATIONS" \
  --precision "$OURS_PRECISION"

# Alternate the two trainers round by round, so that a slow spell of this shared machine
# (other jobs, thermal state) falls on both rather than on one.
for round in $(seq 1 "$ROUNDS"); do
  dir=$RESULTS/round$round
  mkdir -p "$dir"
  echo "round $round/$ROUNDS: rlhf-dist ppo"
  .venv/bin/rlhf-dist ppo --config "$OUT/ours.yaml" run.output_dir="$dir/ours" \
    > "$dir/ours.log" 2>&1 || { tail -20 "$dir/ours.log"; exit 1; }
  echo "round $round/$ROUNDS: TRL PPOTrainer"
  .venv-trl/bin/python launch/bench/vs_trl_trl.py "$OUT" "$dir/trl.json" \
    --iterations "$ITERATIONS" --output-dir "$dir/trl_out" --precision "$TRL_PRECISION" \
    > "$dir/trl.log" 2>&1 || { tail -20 "$dir/trl.log"; exit 1; }
done

.venv/bin/python launch/bench/vs_trl_report.py "$OUT" "$RESULTS" 2>&1 | tee "$RESULTS/report.txt" \
  | grep -v "Setting accelerator to CPU"
