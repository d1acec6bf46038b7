#!/usr/bin/env bash
# PPO with LoRA actor and critic on ONE GPU (launch/configs/ppo_lora_1gpu.yaml).
#   bash launch/single_gpu_lora.sh model.policy=/data/sft/final model.reward=/data/rm/final data.train=/data/prompts.jsonl
# Extra arguments are rlhf-dist overrides (section.key=value). Pick the GPU with CUDA_VISIBLE_DEVICES.
# Precision follows model.dtype (bf16) in the run config: no --mixed_precision here.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .venv/bin/activate ]; then
  . .venv/bin/activate
fi
exec accelerate launch --config_file accelerate_configs/single_gpu.yaml \
  -m rlhf_dist ppo --config launch/configs/ppo_lora_1gpu.yaml "$@"
