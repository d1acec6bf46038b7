#!/usr/bin/env bash
# GRPO, rlhf_dist vs TRL's GRPOTrainer (1.16.0) on a real model: seconds per iteration on
# the same weights, chat template, prompts, reward and settings (4 prompts x 4 samples, 48
# new tokens, fp32, one optimizer step per rollout, k3 KL in the loss at 0.04, token-mean
# loss, lr 1e-5, temperature 1), rounds alternated; plus the FLOP floor.
# A benchmark, not a test: nothing here is run by launch/test.sh or CI.
#
# Usage: bash launch/bench/vs_trl_grpo.sh [ROUNDS=2] [ITERATIONS=6] [SIZE=smollm2|deep]
#          [DTYPE=float32|bfloat16] [VLLM=0|1] [TOKENIZER=dir (deep: SmolLM2's tokenizer files)]
#   VLLM=1: both generate with vLLM (ours generation.backend=vllm, TRL's colocate mode; GPUs).
#   OURS_ARGS="key=value ...": config overrides for ours (e.g. perf.retain_host_memory=false).
#   TRL_RETAIN=1: TRL's process gets glibc's malloc set as ours sets it for itself by
#     default (perf.retain_host_memory: no mmap, no trim; here through MALLOC_* variables),
#     to show what of the gap that setting is. Off by default: TRL as its users run it.
# Output: the table (medians, ratio, floor, fairness notes); raw numbers in
# runs/bench/vs_trl_grpo/<size>/results/ (summary.json, report.txt).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${ROUNDS:-2}
ITERATIONS=${ITERATIONS:-6}
SIZE=${SIZE:-smollm2}
DTYPE=${DTYPE:-float32}
VLLM=${VLLM:-0}
suffix=""
[ "$VLLM" = 1 ] && suffix=-vllm
[ "${TRL_RETAIN:-0}" = 1 ] && suffix=$suffix-trl-retain
OUT=${OUT:-runs/bench/vs_trl_grpo/$SIZE-$DTYPE$suffix}
RESULTS=$OUT/results

# PYTHON / TRL_PYTHON: other interpreters (a GPU image with trl on its path: both the same).
PY=${PYTHON:-.venv/bin/python}
TRL_PY=${TRL_PYTHON:-.venv-trl-grpo/bin/python}
[ -n "${PYTHON:-}" ] || [ -x .venv/bin/python ] || bash launch/setup.sh

# TRL in its own venv so it can never change the project's dependencies: torch first (the
# project's CPU wheel, so trl's resolution finds it satisfied), then transformers,
# accelerate and datasets at the project's pins so both sides run the same Llama code.
pin() { grep -oP "^$1==\K.*" launch/constraints.txt; }
if [ -z "${TRL_PYTHON:-}" ] && ! "$TRL_PY" -c "import trl" 2>/dev/null; then
  python3 -m venv .venv-trl-grpo
  .venv-trl-grpo/bin/pip install --quiet "torch==$(pin torch)"
  .venv-trl-grpo/bin/pip install --quiet trl==1.16.0 "transformers==$(pin transformers)" \
    "accelerate==$(pin accelerate)" "datasets==$(pin datasets)"
fi

rm -rf "$OUT"
"$PY" launch/bench/vs_trl_grpo_prepare.py "$OUT" --size "$SIZE" --iterations "$ITERATIONS" \
  --dtype "$DTYPE" ${TOKENIZER:+--tokenizer "$TOKENIZER"}
ours_vllm=() trl_vllm=() trl_env=(env)
[ "${TRL_RETAIN:-0}" = 1 ] && trl_env=(env MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2147483647)
[ "$VLLM" = 1 ] && ours_vllm=(generation.backend=vllm) trl_vllm=(--vllm)

export PYTHONPATH=$PWD/launch/bench${PYTHONPATH:+:$PYTHONPATH}  # grpo_reward for ours
# Alternate round by round so that a slow spell of the machine falls on both sides.
for round in $(seq 1 "$ROUNDS"); do
  dir=$RESULTS/round$round
  mkdir -p "$dir"
  echo "round $round/$ROUNDS: rlhf-dist ppo (grpo)"
  "$PY" -m rlhf_dist ppo --config "$OUT/ours.yaml" run.output_dir="$dir/ours" \
    "${ours_vllm[@]}" ${OURS_ARGS:-} > "$dir/ours.log" 2>&1 || { tail -20 "$dir/ours.log"; exit 1; }
  echo "round $round/$ROUNDS: TRL GRPOTrainer"
  "${trl_env[@]}" "$TRL_PY" launch/bench/vs_trl_grpo_trl.py "$OUT" "$dir/trl.json" \
    --output-dir "$dir/trl_out" "${trl_vllm[@]}" > "$dir/trl.log" 2>&1 || { tail -20 "$dir/trl.log"; exit 1; }
done

"$PY" launch/bench/vs_trl_grpo_report.py "$OUT" "$RESULTS" 2>&1 | tee "$RESULTS/report.txt"
