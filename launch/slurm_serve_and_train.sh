#!/usr/bin/env bash
# Rollout servers on some nodes, the GRPO trainer on the others, under SLURM
# (docs/serving.md, "Several nodes"). The first SERVE_NODES nodes of the allocation run
# `rlhf-dist serve`, one data-parallel server per GPU, listening on their node's address;
# the other nodes run the trainer under DeepSpeed ZeRO-3 or FSDP2 (ENGINE; one `accelerate
# launch` per node, as launch/slurm_ppo.sh), its rollouts sampled by the servers, the
# weights broadcast to them from trainer rank 0 after every update
# (generation.server_sync_address: rank 0's node). The servers stop with the job.
#
# Submit from the repository root:
#   sbatch launch/slurm_serve_and_train.sh my_run.yaml                # 1 serving + 1 training node
#   sbatch --nodes=4 launch/slurm_serve_and_train.sh my_run.yaml      # 1 serving + 3 training
#   SERVE_NODES=2 STALENESS=1 sbatch --nodes=6 launch/slurm_serve_and_train.sh my_run.yaml ppo.iterations=500
#
# my_run.yaml is the run's config (model.policy, data.train, reward, ...): the servers read
# their part of it, the trainer all of it; its ppo.rollout_batch_size and
# ppo.minibatch_size must divide by the trainer's world size ((nodes - SERVE_NODES) x
# GPUS_PER_NODE), checked before anything loads. Extra arguments are the trainer's overrides.
#   SERVE_NODES=1             nodes that serve (the first ones of the allocation)
#   GPUS_PER_NODE=8           servers per serving node, ranks per training node;
#                             cpu: one server per serving node and one trainer rank per
#                             training node on the CPU, over gloo (a test of the recipe)
#   ENGINE=zero3              the trainer's engine, zero3 or fsdp2: its accelerate config is
#                             zero3_multinode.yaml or fsdp2_multinode.yaml (with cpu:
#                             cpu_zero3_2machines.yaml, cpu_fsdp2.yaml; launch/slurm_engine.sh)
#   ACCELERATE_CONFIG=path    another accelerate config for the trainer instead; placement
#                             is set on the command line
#   STALENESS=0               ppo.max_staleness (1: the next rollout is sampled while this
#                             iteration trains)
#   SERVE_ARGS="serve.engine=vllm"   the servers' own overrides
#   BASE_PORT=8100            server i of a node listens on BASE_PORT+i
#   LOGS=runs/serve           the servers' logs, one per node
# The servers listen on 0.0.0.0 (serve.host): every trainer rank reaches them over the
# cluster network, and whoever else can reach the nodes could too, were it not for the
# token, RLHF_DIST_SERVER_TOKEN (made here when unset, never printed; srun passes the
# environment on). Keep the ports closed to anything outside the cluster.
#
# Directives (comments on their own lines: sbatch does not strip trailing ones): two
# nodes; one task per node (the node's servers, or its `accelerate launch`, which forks
# the ranks); 8 GPUs per node; the node's cores (site specific); wall time; one log.
#SBATCH --job-name=rlhf-serve-train
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=96
#SBATCH --time=48:00:00
#SBATCH --output=%x-%j.out

set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
[ -f .venv/bin/activate ] && . .venv/bin/activate
CONFIG=${1:?usage: sbatch [--nodes=N] launch/slurm_serve_and_train.sh CONFIG [overrides]}
shift
SERVE_NODES=${SERVE_NODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
BASE_PORT=${BASE_PORT:-8100}
LOGS=${LOGS:-runs/serve}
mkdir -p "$LOGS"
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
if [ "${#NODES[@]}" -le "$SERVE_NODES" ]; then
  echo "slurm_serve_and_train: ${#NODES[@]} nodes, SERVE_NODES=$SERVE_NODES: none left to train" >&2
  exit 2
fi
SERVERS=("${NODES[@]:0:$SERVE_NODES}")
TRAINERS=("${NODES[@]:$SERVE_NODES}")
PER_NODE=$GPUS_PER_NODE; [ "$GPUS_PER_NODE" = cpu ] && PER_NODE=1
. launch/slurm_engine.sh
ACCELERATE_CONFIG=${ACCELERATE_CONFIG:-$(engine_config "${ENGINE:-zero3}" "$GPUS_PER_NODE")}
export RLHF_DIST_SERVER_TOKEN=${RLHF_DIST_SERVER_TOKEN:-$(python -c "import secrets; print(secrets.token_hex(16))")}
export CONFIG BASE_PORT LOGS GPUS_PER_NODE PER_NODE ACCELERATE_CONFIG SERVE_ARGS="${SERVE_ARGS:-}"
export SRUN_CPUS_PER_TASK="${SLURM_CPUS_PER_TASK:-1}"  # srun no longer inherits it (22.05+)

# The servers: one srun step over the serving nodes, each node starting PER_NODE servers
# and waiting on them (the step, and so the servers, end when the job cancels it below).
srun --nodes="$SERVE_NODES" --ntasks-per-node=1 --nodelist="$(IFS=,; echo "${SERVERS[*]}")" \
  --kill-on-bad-exit=1 bash -c '
  node=$(hostname)
  for i in $(seq 0 $((PER_NODE - 1))); do
    devices=$i; [ "$GPUS_PER_NODE" = cpu ] && devices=""
    # shellcheck disable=SC2086  # SERVE_ARGS: words
    CUDA_VISIBLE_DEVICES=$devices python -m rlhf_dist serve --config "$CONFIG" serve.host=0.0.0.0 \
      serve.port=$((BASE_PORT + i)) $SERVE_ARGS > "$LOGS/serve_${node}_$i.log" 2>&1 &
  done
  wait
' &
SERVING=$!
# the job's end cancels the step too; stopping it here lets the servers finish first
stop_servers() { kill "$SERVING" 2>/dev/null || return 0; wait "$SERVING" 2>/dev/null || true; }
trap stop_servers EXIT

urls=()
for node in "${SERVERS[@]}"; do
  for i in $(seq 0 $((PER_NODE - 1))); do urls+=("http://$node:$((BASE_PORT + i))"); done
done
python launch/wait_servers.py "${urls[@]}"
list=$(IFS=,; echo "${urls[*]}")
MAIN_ADDR=${TRAINERS[0]}
PORT=$((20000 + SLURM_JOB_ID % 10000))  # per job: two jobs on one node do not collide
export MAIN_ADDR PORT
echo "rollout servers up: $list; trainer on ${TRAINERS[*]} (rendezvous $MAIN_ADDR:$PORT)"

# The trainer: one `accelerate launch` per training node (launch/slurm_ppo.sh explains the
# quoting); rank 0 runs on MAIN_ADDR, where the servers join the weight-sync group.
srun --nodes="${#TRAINERS[@]}" --ntasks-per-node=1 --nodelist="$(IFS=,; echo "${TRAINERS[*]}")" \
  --kill-on-bad-exit=1 -l bash -c '
  nodes=$SLURM_NNODES
  exec python -m accelerate.commands.launch --config_file "$ACCELERATE_CONFIG" \
    --num_machines "$nodes" --num_processes "$((nodes * PER_NODE))" \
    --machine_rank "$SLURM_NODEID" --main_process_ip "$MAIN_ADDR" --main_process_port "$PORT" \
    -m rlhf_dist grpo --config "$CONFIG" generation.backend=server "generation.server_urls=[$0]" \
    generation.server_sync_address="$MAIN_ADDR" "$@"
' "$list" "ppo.max_staleness=${STALENESS:-0}" "$@"
