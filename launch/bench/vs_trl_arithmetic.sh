#!/usr/bin/env bash
# The arithmetic demo (`rlhf-dist demo --task arithmetic --algorithm grpo`) against TRL's
# GRPOTrainer (1.16.0) at matched settings: the same SmolLM2-135M-Instruct, the same 160
# training rows (each side's own order), `last_number` reward, 8 prompts x 8 samples, 24
# new tokens, temperature 1, one optimizer step per rollout, lr 2e-5, no KL, token-mean
# loss, fp32, 2 threads; AdamW epsilon differs (ours 1e-5, TRL 1e-8). Both trained
# policies are scored by the demo's own held-out evaluation (greedy; the same held-out
# rows), so the accuracies compare; the times are each side's
# training loop (ours: the GRPO stage's wall time; TRL: trainer.train()).
# A benchmark, not a test: nothing here is run by launch/test.sh or CI.
#
# Usage: bash launch/bench/vs_trl_arithmetic.sh [SEEDS="0 1"] [QUICK=0|1] [TRL_ARGS="--adam-epsilon 1e-5 --shuffle"]
# (TRL_ARGS go to vs_trl_arithmetic_trl.py: AdamW epsilon, per-seed shuffling of the rows)
# Output: the table (per seed and mean: accuracy before -> after, GRPO seconds, ratio);
# raw files in runs/bench/vs_trl_arithmetic/ (seed<N>/ours/summary.json, trl.json,
# eval/summary.json, report.txt).
set -euo pipefail
cd "$(dirname "$0")/../.."
SEEDS=${SEEDS:-0 1}
QUICK=${QUICK:-0}
OUT=${OUT:-runs/bench/vs_trl_arithmetic}
PY=${PYTHON:-.venv/bin/python}
TRL_PY=${TRL_PYTHON:-.venv-trl-grpo/bin/python}
[ -n "${PYTHON:-}" ] || [ -x .venv/bin/python ] || bash launch/setup.sh
# TRL's venv is the GRPO benchmark's (vs_trl_grpo.sh creates it the same way).
if [ -z "${TRL_PYTHON:-}" ] && ! "$TRL_PY" -c "import trl" 2>/dev/null; then
  pin() { grep -oP "^$1==\K.*" launch/constraints.txt; }
  python3 -m venv .venv-trl-grpo
  .venv-trl-grpo/bin/pip install --quiet "torch==$(pin torch)"
  .venv-trl-grpo/bin/pip install --quiet trl==1.16.0 "transformers==$(pin transformers)" \
    "accelerate==$(pin accelerate)" "datasets==$(pin datasets)"
fi
quick=() && [ "$QUICK" = 1 ] && quick=(--quick)

rm -rf "$OUT"
"$PY" launch/bench/vs_trl_arithmetic_prepare.py "$OUT" "${quick[@]}"
for seed in $SEEDS; do
  dir=$OUT/seed$seed
  mkdir -p "$dir"
  echo "seed $seed: rlhf-dist demo --task arithmetic"
  "$PY" -m rlhf_dist demo --task arithmetic --algorithm grpo --seed "$seed" "${quick[@]}" \
    --output-dir "$dir/ours" perf.num_threads=2 > "$dir/ours.log" 2>&1 \
    || { tail -20 "$dir/ours.log"; exit 1; }
  echo "seed $seed: TRL GRPOTrainer"
  # shellcheck disable=SC2086  # TRL_ARGS: words
  "$TRL_PY" launch/bench/vs_trl_arithmetic_trl.py "$OUT" "$dir/trl.json" --seed "$seed" ${TRL_ARGS:-} \
    --output-dir "$dir/trl_out" > "$dir/trl.log" 2>&1 || { tail -20 "$dir/trl.log"; exit 1; }
  echo "seed $seed: the demo's held-out evaluation of TRL's policy"
  "$PY" -m rlhf_dist eval --config "$OUT/eval.json" model.policy="$dir/trl_out/final" \
    run.output_dir="$dir/eval" run.seed="$seed" > "$dir/eval.log" 2>&1 \
    || { tail -20 "$dir/eval.log"; exit 1; }
done
"$PY" launch/bench/vs_trl_arithmetic_report.py "$OUT" $SEEDS 2>&1 | tee "$OUT/report.txt"
