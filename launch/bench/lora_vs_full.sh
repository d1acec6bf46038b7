#!/usr/bin/env bash
# LoRA vs full fine-tuning at the same batch layout, on the CPU: a Llama of hidden 256 x
# 12 layers (vocab 1000), actor + critic LoRA (r=8) against both trained in full, PPO with
# 16 prompts x 16 tokens, 4 epochs x 4 minibatches of 4. Runs alternate (full, lora, full,
# lora, ...) so a slow spell of the machine falls on both; the table gives each run's
# medians over iterations 2.. and the ratios of the medians of the runs.
# Usage: bash launch/bench/lora_vs_full.sh [ROUNDS=2] [ITERATIONS=4] [OUT=runs/bench/lora_vs_full]
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${ROUNDS:-2}
ITERATIONS=${ITERATIONS:-4}
OUT=${OUT:-runs/bench/lora_vs_full}
[ -f .venv/bin/activate ] && . .venv/bin/activate
mkdir -p "$OUT"
[ -f "$OUT/policy/config.json" ] || python launch/bench/suite.py prepare "$OUT" --shape lora --prompts 256
common=(
  model.policy="$OUT/policy" model.reward="$OUT/reward" data.train="$OUT/prompts.jsonl"
  run.histogram_every=0 run.samples_every=0 run.progress=false
  ppo.iterations="$ITERATIONS" ppo.rollout_batch_size=16 ppo.rollout_micro_batch_size=16
  ppo.minibatch_size=4 ppo.micro_batch_size=4 ppo.ppo_epochs=4
  generation.max_new_tokens=16 generation.min_new_tokens=16
)
runs=()
for round in $(seq 1 "$ROUNDS"); do
  for case in full lora; do
    extra=(); [ "$case" = lora ] && extra=(lora.enabled=true lora.critic=true lora.r=8 lora.alpha=16)
    dir=$OUT/$case-$round
    rm -rf "$dir"
    echo "round $round/$ROUNDS: $case"
    python -m rlhf_dist ppo "${common[@]}" "${extra[@]}" run.output_dir="$dir" > "$dir.log" 2>&1 \
      || { tail -20 "$dir.log"; exit 1; }
    runs+=("$dir")
  done
done
python launch/bench/suite.py report "${runs[@]}" | tee "$OUT/table.txt"
python launch/bench/suite.py ratio "$OUT" lora full | tee -a "$OUT/table.txt"
