# Sourced by launch/slurm_ppo.sh and launch/slurm_serve_and_train.sh: which accelerate config
# a multi-node launch uses for ENGINE (docs/distributed.md "Choosing the engine").
#   ENGINE=zero3   DeepSpeed ZeRO-3 (the default)
#   ENGINE=fsdp2   torch FSDP2 (distributed/fsdp2.py shards every decoder layer)
# Placement (machines, processes, rank, address) is always given on the command line, so
# one config serves any number of nodes.

# engine_config ENGINE GPUS_PER_NODE: print the config's path (GPUS_PER_NODE=cpu: the CPU,
# gloo one that tests the recipe on one machine); an unknown ENGINE: one line, status 2.
engine_config() {
  case "$1:$2" in
    zero3:cpu) echo accelerate_configs/cpu_zero3_2machines.yaml ;;
    zero3:*) echo accelerate_configs/zero3_multinode.yaml ;;
    fsdp2:cpu) echo accelerate_configs/cpu_fsdp2.yaml ;;
    fsdp2:*) echo accelerate_configs/fsdp2_multinode.yaml ;;
    *)
      echo "ENGINE=$1: not an engine (zero3 or fsdp2)" >&2
      return 2
      ;;
  esac
}
