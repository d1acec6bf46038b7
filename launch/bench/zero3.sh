#!/usr/bin/env bash
# DeepSpeed stage 0 vs ZeRO-3 on 2 CPU ranks, two parts:
#  1. per-rank model-state memory and generation time (a 4.7M-parameter Llama;
#     zero3_probe.py): what partitioning saves and what gathering costs;
#  2. whole PPO iterations on a deep, narrow Llama (hidden 64 x 24 layers, vocab 1000,
#     where ZeRO-3's per-parameter and per-module costs dominate): 16 prompts x 16 tokens,
#     4 epochs x 4 minibatches, ppo.micro_batch_size=2; stage 0 and ZeRO-3 alternate for
#     ROUNDS rounds; medians of time/total, generate, score and update over iterations 2..
# Usage: bash launch/bench/zero3.sh [--dtype bfloat16]    (env: ROUNDS=2 ITERATIONS=4 PARTS="1 2")
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
ROUNDS=${ROUNDS:-2}
ITERATIONS=${ITERATIONS:-4}
PARTS=${PARTS:-1 2}
out=$(mktemp -d)
if [[ " $PARTS " == *" 1 "* ]]; then
  for stage in 0 3; do
    accelerate launch --config_file "accelerate_configs/cpu_zero${stage}.yaml" \
      launch/bench/zero3_probe.py --out "$out" "$@" > "$out/stage${stage}.log" 2>&1 \
      || { tail -30 "$out/stage${stage}.log"; exit 1; }
  done
  python launch/bench/zero3_probe.py --out "$out" --report
fi
if [[ " $PARTS " == *" 2 "* ]]; then
  python launch/bench/suite.py prepare "$out/deep" --shape deep > /dev/null 2>&1
  runs=()
  for round in $(seq 1 "$ROUNDS"); do
    for stage in 0 3; do
      dir=$out/deep/zero$stage-$round
      echo "round $round/$ROUNDS: stage $stage" >&2
      accelerate launch --config_file "accelerate_configs/cpu_zero${stage}.yaml" -m rlhf_dist ppo \
        model.policy="$out/deep/policy" model.reward="$out/deep/reward" \
        data.train="$out/deep/prompts.jsonl" run.output_dir="$dir" run.progress=false \
        run.histogram_every=0 run.samples_every=0 ppo.iterations="$ITERATIONS" \
        ppo.rollout_batch_size=16 ppo.rollout_micro_batch_size=16 ppo.minibatch_size=4 \
        ppo.micro_batch_size=2 generation.max_new_tokens=16 generation.min_new_tokens=16 \
        > "$dir.log" 2>&1 || { tail -30 "$dir.log"; exit 1; }
      runs+=("$dir")
    done
  done
  python launch/bench/suite.py report "${runs[@]}"
  python launch/bench/suite.py ratio "$out/deep" zero3 zero0
fi
