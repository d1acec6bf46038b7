#!/usr/bin/env bash
# Rollout servers beside the trainer on one node (docs/serving.md): `rlhf-dist serve` on
# SERVE_GPUS, one data-parallel server per GPU, and the GRPO trainer on TRAIN_GPUS under
# DeepSpeed ZeRO-3, its rollouts sampled by the servers (generation.backend=server), the
# weights sent to them after every update.
#
#   SERVE_GPUS=0,1 TRAIN_GPUS=2,3,4,5,6,7 bash launch/serve_and_train.sh my_run.yaml [overrides]
#
# my_run.yaml is the run's config (model.policy, data.train, reward, ...): the servers read
# their part of it (model.policy, model.dtype, serve.*, generation.vllm_* with
# serve.engine=vllm), the trainer all of it. Extra arguments are the trainer's overrides.
#   STALENESS=1               ppo.max_staleness (0: on-policy; 1: the next rollout is
#                             sampled while this iteration trains)
#   SERVE_ARGS="serve.engine=vllm"   the servers' own overrides
#   ACCELERATE_CONFIG=...     default accelerate_configs/zero3.yaml
#   BASE_PORT=8100            server i listens on 127.0.0.1:BASE_PORT+i
#   LOGS=runs/serve           the servers' logs
# The token the servers require is RLHF_DIST_SERVER_TOKEN, made here when unset and never
# printed. Without GPUs (SERVE_GPUS=cpu TRAIN_GPUS=cpu): one server and one trainer
# process on the CPU, a smoke test of the recipe.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .venv/bin/activate ] && . .venv/bin/activate
CONFIG=${1:?usage: SERVE_GPUS=0,1 TRAIN_GPUS=2,...,7 bash launch/serve_and_train.sh CONFIG [overrides]}
shift
SERVE_GPUS=${SERVE_GPUS:?set SERVE_GPUS (e.g. 0,1; cpu without GPUs)}
TRAIN_GPUS=${TRAIN_GPUS:?set TRAIN_GPUS (e.g. 2,3,4,5,6,7; cpu without GPUs)}
BASE_PORT=${BASE_PORT:-8100}
LOGS=${LOGS:-runs/serve}
mkdir -p "$LOGS"
export RLHF_DIST_SERVER_TOKEN=${RLHF_DIST_SERVER_TOKEN:-$(python -c "import secrets; print(secrets.token_hex(16))")}

pids=() urls=()
stop_servers() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; }
trap stop_servers EXIT
i=0
for gpu in ${SERVE_GPUS//,/ }; do
  port=$((BASE_PORT + i))
  devices=$gpu; [ "$gpu" = cpu ] && devices=""
  # shellcheck disable=SC2086  # SERVE_ARGS: words
  CUDA_VISIBLE_DEVICES=$devices python -m rlhf_dist serve --config "$CONFIG" \
    serve.port="$port" ${SERVE_ARGS:-} > "$LOGS/serve_$i.log" 2>&1 &
  pids+=($!) urls+=("http://127.0.0.1:$port")
  i=$((i + 1))
done
# every server answers /health before the trainer starts (model loading takes a while)
python launch/wait_servers.py "${urls[@]}"
list=$(IFS=,; echo "${urls[*]}")
echo "rollout servers up: $list; trainer on ${TRAIN_GPUS}"
train=(-m rlhf_dist grpo --config "$CONFIG" generation.backend=server
       "generation.server_urls=[$list]" "ppo.max_staleness=${STALENESS:-0}" "$@")
if [ "$TRAIN_GPUS" = cpu ]; then
  CUDA_VISIBLE_DEVICES="" python "${train[@]}"
else
  n=$(echo "$TRAIN_GPUS" | tr ',' '\n' | wc -l)
  CUDA_VISIBLE_DEVICES=$TRAIN_GPUS python -m accelerate.commands.launch \
    --config_file "${ACCELERATE_CONFIG:-accelerate_configs/zero3.yaml}" --num_processes "$n" \
    "${train[@]}"
fi
