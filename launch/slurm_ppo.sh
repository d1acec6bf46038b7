#!/usr/bin/env bash
# Multi-node PPO under SLURM with DeepSpeed ZeRO-3 or FSDP2: one `accelerate launch` per
# node, each starting 8 ranks (one per GPU); DeepSpeed's "standard" multinode launcher (and
# FSDP2's) = plain torchrun on every node, so no pdsh/ssh between nodes is needed.
#
# Submit from the repository root:
#   sbatch launch/slurm_ppo.sh                                  # 2 nodes (the default below)
#   sbatch --nodes=4 launch/slurm_ppo.sh model.policy=/data/sft-7b/final run.output_dir=runs/x
#   ENGINE=fsdp2 sbatch launch/slurm_ppo.sh                     # FSDP2 instead of ZeRO-3
#
# ENGINE=zero3 (default) or fsdp2 chooses the accelerate config (launch/slurm_engine.sh:
# zero3_multinode.yaml or fsdp2_multinode.yaml); ACCELERATE_CONFIG=path names another.
# Under fsdp2 the frozen reference and reward model are replicated
# (distributed.frozen_models=replicate: FSDP2 does not partition frozen models, and the run
# config's `partition` would be refused), a whole bf16 7B copy of each on every GPU.
#
# Extra arguments are rlhf-dist overrides (section.key=value) appended to the config.
# The run config is launch/configs/ppo_7b_zero3.yaml; its ppo.rollout_batch_size and
# ppo.minibatch_size must stay divisible by the world size (nodes x 8) - rlhf-dist checks
# that before loading anything.
#
# Directives (keep comments on their own lines: sbatch does not strip trailing comments):
# two machines (everything below follows $SLURM_NNODES; `sbatch --nodes=N` overrides it);
# ONE task per node - it is `accelerate launch`, which forks the 8 ranks itself;
# 8 GPUs per node; all of a node's cores for its 8 ranks (site specific: set to your nodes);
# wall time; one log file for the whole job (srun -l tags each line with its node's task id).
#SBATCH --job-name=rlhf-ppo
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=96
#SBATCH --time=48:00:00
#SBATCH --output=%x-%j.out

set -euo pipefail

# sbatch runs a copy of this script from the spool directory: go to where it was submitted
# (the repository root), so the relative config paths below resolve.
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
if [ -f .venv/bin/activate ]; then
  . .venv/bin/activate
fi
. launch/slurm_engine.sh
ACCELERATE_CONFIG=${ACCELERATE_CONFIG:-$(engine_config "${ENGINE:-zero3}" gpu)}
ENGINE_ARGS=""
[ "${ENGINE:-zero3}" = fsdp2 ] && ENGINE_ARGS=distributed.frozen_models=replicate
export ACCELERATE_CONFIG ENGINE_ARGS

# Ranks per node = GPUs per node; keep it equal to --gpus-per-node above.
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
# Rank 0 of the whole job runs on the first node of the allocation: its hostname is the
# rendezvous address every node connects to.
MAIN_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
# A port derived from the job id, so two jobs sharing a node do not collide (range 20000-29999).
PORT=$((20000 + SLURM_JOB_ID % 10000))
export MAIN_ADDR PORT GPUS_PER_NODE

# Since Slurm 22.05 srun does not inherit --cpus-per-task from sbatch: without this each
# node's task (and so all 8 ranks) would be pinned to a single core.
export SRUN_CPUS_PER_TASK="${SLURM_CPUS_PER_TASK:-1}"

# NCCL tips: uncomment what your cluster needs (interface names are site specific).
# export NCCL_SOCKET_IFNAME=ib0
# export NCCL_IB_HCA=mlx5
# export NCCL_DEBUG=WARN

echo "PPO on $SLURM_NNODES nodes x $GPUS_PER_NODE GPUs ($ACCELERATE_CONFIG); rendezvous $MAIN_ADDR:$PORT"

# srun starts one task per node (ntasks-per-node=1). The command is in SINGLE quotes so that
# $SLURM_NODEID - this node's index, 0..nnodes-1, which becomes --machine_rank - is expanded
# by bash on each node, not once here on the first one. "$@" (the user's overrides) is passed
# as positional arguments of that bash (after the "_" that fills $0), which keeps their
# quoting intact. --kill-on-bad-exit=1 ends every node as soon as one fails instead of
# leaving the others waiting in a collective until timeout.
#
# All placement values are given on the command line; they override the placeholders in
# the accelerate config (zero3_multinode.yaml, fsdp2_multinode.yaml). No --mixed_precision:
# bf16 follows model.dtype in the run config (docs/distributed.md, "Which value lives
# where"). $ENGINE_ARGS (unquoted: no words, or one) is expanded on each node.
srun --ntasks-per-node=1 --kill-on-bad-exit=1 -l bash -c '
  exec accelerate launch \
    --config_file "$ACCELERATE_CONFIG" \
    --num_machines "$SLURM_NNODES" \
    --num_processes "$((SLURM_NNODES * GPUS_PER_NODE))" \
    --machine_rank "$SLURM_NODEID" \
    --main_process_ip "$MAIN_ADDR" \
    --main_process_port "$PORT" \
    -m rlhf_dist ppo --config launch/configs/ppo_7b_zero3.yaml $ENGINE_ARGS "$@"
' _ "$@"
