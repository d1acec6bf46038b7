#!/usr/bin/env bash
# rlhf_dist against TRL, one task per run. A benchmark, not a test: nothing here is run by
# launch/test.sh or CI (TRL is not a dependency: it lives in its own venv, made here, so it
# can never change the project's). docs/benchmarks.md has the figures of each.
#
# Usage: bash launch/bench/vs_trl.sh TASK      (settings as environment variables)
#   grpo        GRPO vs TRL 1.16.0's GRPOTrainer on a real model: s/iteration on the same
#               weights, chat template, prompts, reward and settings (4 prompts x 4 samples,
#               48 new tokens, one optimizer step per rollout, k3 KL in the loss at 0.04,
#               token-mean loss, lr 1e-5, temperature 1), rounds alternated.
#               ROUNDS=2 ITERATIONS=6 SIZE=smollm2|deep DTYPE=float32|bfloat16 VLLM=0|1
#               TOKENIZER=dir (deep: SmolLM2's tokenizer files) OURS_ARGS="key=value ..."
#               TRL_RETAIN=1 (TRL's process gets glibc's malloc set as ours sets it for
#               itself, perf.retain_host_memory) OUT=runs/bench/vs_trl_grpo/<size>-<dtype>
#   ppo         PPO vs TRL 1.10.0's PPOTrainer: s/iteration on a tiny random-init Llama,
#               batch 32, response 32, 4 epochs x 4 minibatches. ROUNDS=3 ITERATIONS=6
#               SIZE=tiny|small PRECISION=fp32|bf16 (OURS_PRECISION / TRL_PRECISION: one
#               side each) SKIP=1,3 (rounds the report leaves out)
#   arithmetic  the arithmetic demo vs TRL's GRPOTrainer at matched settings: held-out
#               accuracy before -> after and GRPO seconds, per seed. SEEDS="0 1" QUICK=0|1
#               TRL_ARGS="--adam-epsilon 1e-5 --shuffle"
#   preference  SimPO and ORPO: our losses, metrics and gradients against TRL's (CPOTrainer,
#               ORPOTrainer) on the same pairs; exit 1 above a difference of 1e-4
#   loss-check  one GRPO update on one fixed batch through both trainers' code
#               (vs_trl_loss_check.py; ~10 minutes); --task vision: a DPO step and a
#               GRPO update on a tiny LLaVA's batch (~1 minute; exit 1 above 1e-4)
#   profile     where one of our PPO iterations (the ppo task's inputs) spends its time
# The timed tasks (grpo, ppo) print medians, the ratio ours/TRL, the FLOP floor and the
# roofline floor of each phase (peaks measured on this machine; harness.py), then fairness
# notes; raw numbers in OUT/results/ (summary.json, report.txt).
# PYTHON / TRL_PYTHON: other interpreters (a GPU image with trl on its path: both the same).
set -euo pipefail
cd "$(dirname "$0")/../.."
TASK=${1:?usage: bash launch/bench/vs_trl.sh grpo|ppo|arithmetic|preference|loss-check|profile}
PY=${PYTHON:-.venv/bin/python}
[ -n "${PYTHON:-}" ] || [ -x .venv/bin/python ] || bash launch/setup.sh
OURS=launch/bench/vs_trl_ours.py THEIRS=launch/bench/vs_trl_trl.py

# TRL's venv: torch first, pinned to the project's CPU wheel, so that trl's dependency
# resolution finds it satisfied instead of pulling a CUDA build; transformers, accelerate
# and datasets at the project's pins, so that both sides run the same Llama code.
pin() { grep -oP "^$1==\K.*" launch/constraints.txt; }
trl_venv() {  # DIR TRL_VERSION [pins: package==version ...]
  local dir=$1 version=$2
  shift 2
  if ! "$dir/bin/python" -c "import trl" 2>/dev/null; then
    python3 -m venv "$dir"
    "$dir/bin/pip" install --quiet "torch==$(pin torch)"
    "$dir/bin/pip" install --quiet "trl==$version" "$@"
  fi
}
trl_grpo_venv() {  # TRL 1.16.0 (grpo, arithmetic, preference, loss-check)
  TRL_PY=${TRL_PYTHON:-.venv-trl-grpo/bin/python}
  [ -n "${TRL_PYTHON:-}" ] || trl_venv .venv-trl-grpo 1.16.0 "transformers==$(pin transformers)" \
    "accelerate==$(pin accelerate)" "datasets==$(pin datasets)"
}
fail() { tail -20 "$1"; exit 1; }

case $TASK in
grpo)
  ROUNDS=${ROUNDS:-2} ITERATIONS=${ITERATIONS:-6} SIZE=${SIZE:-smollm2} DTYPE=${DTYPE:-float32}
  VLLM=${VLLM:-0} suffix=""
  [ "$VLLM" = 1 ] && suffix=-vllm
  [ "${TRL_RETAIN:-0}" = 1 ] && suffix=$suffix-trl-retain
  OUT=${OUT:-runs/bench/vs_trl_grpo/$SIZE-$DTYPE$suffix}
  trl_grpo_venv
  rm -rf "$OUT"
  "$PY" $OURS grpo prepare "$OUT" --size "$SIZE" --iterations "$ITERATIONS" --dtype "$DTYPE" \
    ${TOKENIZER:+--tokenizer "$TOKENIZER"}
  ours_vllm=() trl_vllm=() trl_env=(env)
  [ "${TRL_RETAIN:-0}" = 1 ] && trl_env=(env MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2147483647)
  [ "$VLLM" = 1 ] && ours_vllm=(generation.backend=vllm) trl_vllm=(--vllm)
  export PYTHONPATH=$PWD/launch/bench${PYTHONPATH:+:$PYTHONPATH}  # harness:reward for ours
  # Alternate round by round so that a slow spell of the machine falls on both sides.
  for round in $(seq 1 "$ROUNDS"); do
    dir=$OUT/results/round$round
    mkdir -p "$dir"
    echo "round $round/$ROUNDS: rlhf-dist ppo (grpo)"
    # shellcheck disable=SC2086  # OURS_ARGS: words
    "$PY" -m rlhf_dist ppo --config "$OUT/ours.yaml" run.output_dir="$dir/ours" \
      "${ours_vllm[@]}" ${OURS_ARGS:-} > "$dir/ours.log" 2>&1 || fail "$dir/ours.log"
    echo "round $round/$ROUNDS: TRL GRPOTrainer"
    "${trl_env[@]}" "$TRL_PY" $THEIRS grpo "$OUT" "$dir/trl.json" --output-dir "$dir/trl_out" \
      "${trl_vllm[@]}" > "$dir/trl.log" 2>&1 || fail "$dir/trl.log"
  done
  "$PY" $OURS grpo report "$OUT" "$OUT/results" 2>&1 | tee "$OUT/results/report.txt"
  ;;
ppo)
  ROUNDS=${ROUNDS:-3} ITERATIONS=${ITERATIONS:-6} SIZE=${SIZE:-tiny} PRECISION=${PRECISION:-fp32}
  OURS_PRECISION=${OURS_PRECISION:-$PRECISION} TRL_PRECISION=${TRL_PRECISION:-$PRECISION}
  OUT=${OUT:-runs/bench/vs_trl/$SIZE-$OURS_PRECISION-vs-$TRL_PRECISION}
  TRL_PY=${TRL_PYTHON:-.venv-trl/bin/python}
  # TRL 1.10.0 accepts the project's pins: transformers>=4.56.2, accelerate>=1.4.0, datasets>=4.7.0
  [ -n "${TRL_PYTHON:-}" ] || trl_venv .venv-trl 1.10.0 transformers==5.24.0 accelerate==1.15.0 \
    datasets==5.2.0
  rm -rf "$OUT"
  "$PY" $OURS ppo prepare "$OUT" --size "$SIZE" --iterations "$ITERATIONS" \
    --precision "$OURS_PRECISION"
  for round in $(seq 1 "$ROUNDS"); do
    dir=$OUT/results/round$round
    mkdir -p "$dir"
    echo "round $round/$ROUNDS: rlhf-dist ppo"
    "$PY" -m rlhf_dist ppo --config "$OUT/ours.yaml" run.output_dir="$dir/ours" \
      > "$dir/ours.log" 2>&1 || fail "$dir/ours.log"
    echo "round $round/$ROUNDS: TRL PPOTrainer"
    "$TRL_PY" $THEIRS ppo "$OUT" "$dir/trl.json" --iterations "$ITERATIONS" \
      --output-dir "$dir/trl_out" --precision "$TRL_PRECISION" > "$dir/trl.log" 2>&1 \
      || fail "$dir/trl.log"
  done
  "$PY" $OURS ppo report "$OUT" "$OUT/results" --skip "${SKIP:-}" 2>&1 \
    | tee "$OUT/results/report.txt" | grep -v "Setting accelerator to CPU"
  ;;
arithmetic)
  SEEDS=${SEEDS:-0 1} OUT=${OUT:-runs/bench/vs_trl_arithmetic}
  quick=() && [ "${QUICK:-0}" = 1 ] && quick=(--quick)
  trl_grpo_venv
  rm -rf "$OUT"
  "$PY" $OURS arithmetic prepare "$OUT" "${quick[@]}"
  for seed in $SEEDS; do
    dir=$OUT/seed$seed
    mkdir -p "$dir"
    echo "seed $seed: rlhf-dist demo --task arithmetic"
    "$PY" -m rlhf_dist demo --task arithmetic --algorithm grpo --seed "$seed" "${quick[@]}" \
      --output-dir "$dir/ours" perf.num_threads=2 > "$dir/ours.log" 2>&1 || fail "$dir/ours.log"
    echo "seed $seed: TRL GRPOTrainer"
    # shellcheck disable=SC2086  # TRL_ARGS: words
    "$TRL_PY" $THEIRS arithmetic "$OUT" "$dir/trl.json" --seed "$seed" ${TRL_ARGS:-} \
      --output-dir "$dir/trl_out" > "$dir/trl.log" 2>&1 || fail "$dir/trl.log"
    echo "seed $seed: the demo's held-out evaluation of TRL's policy"
    "$PY" -m rlhf_dist eval --config "$OUT/eval.json" model.policy="$dir/trl_out/final" \
      run.output_dir="$dir/eval" run.seed="$seed" > "$dir/eval.log" 2>&1 || fail "$dir/eval.log"
  done
  # shellcheck disable=SC2086  # SEEDS: words
  "$PY" $OURS arithmetic report "$OUT" $SEEDS 2>&1 | tee "$OUT/report.txt"
  ;;
preference)
  OUT=${OUT:-runs/bench/vs_trl_preference}
  trl_grpo_venv
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # this checkout's rlhf_dist, whatever PY has
  rm -rf "$OUT"
  mkdir -p "$OUT"
  "$PY" $OURS preference prepare "$OUT" > "$OUT/ours.log" 2>&1 || fail "$OUT/ours.log"
  "$TRL_PY" $THEIRS preference "$OUT" > "$OUT/trl.log" 2>&1 || fail "$OUT/trl.log"
  "$PY" $OURS preference compare "$OUT" 2>&1 | tee "$OUT/report.txt"
  exit "${PIPESTATUS[0]}"
  ;;
loss-check)
  trl_grpo_venv
  "$PY" launch/bench/vs_trl_loss_check.py --trl-python "$TRL_PY" "${@:2}"
  ;;
profile)
  OUT=${OUT:-runs/bench/vs_trl/tiny-fp32-vs-fp32}
  [ -f "$OUT/ours.yaml" ] || "$PY" $OURS ppo prepare "$OUT"
  "$PY" $OURS ppo profile "$OUT" "${@:2}"
  ;;
*)
  echo "unknown task $TASK: grpo, ppo, arithmetic, preference, loss-check or profile" >&2
  exit 2
  ;;
esac
