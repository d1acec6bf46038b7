"""The single door to Accelerate and DeepSpeed.

Trainers never import accelerate or deepspeed: they get a `Runtime` and call its methods
to prepare models, run micro-batch backward passes, step optimizers, generate and reduce
statistics. `python -m rlhf_dist ...` gives a one-process runtime; `accelerate launch`
(DDP, ZeRO-2, ZeRO-3, FSDP2, multi-node) gives one process per rank running the same code.

Gradient accumulation is ours, not the backends': a trainer divides each micro-batch's
loss SUM by the token (or pair) count of the whole global batch, calls
`micro_backward(..., last=...)` per micro-batch and `optimizer_step` once. The runtime
makes every backend produce exactly that gradient (DeepSpeed's own 1/GAS loss scaling is
turned off; its averaging over ranks is undone by the x world_size the trainer applies).

Modules, one concern each (`Runtime` composes them; nothing else here imports the
backends):
- backend.py: the Accelerator, rank/world/device, `prepare` and `unwrap`, seeding;
- deepspeed_config.py: DeepSpeed's "auto" config entries filled from our config, the
  accelerate config's DeepSpeed file found from any working directory;
- fsdp2.py: FSDP2 (`fully_shard`) as the second sharded engine: sharding, clipping over
  shards, whole weights, full state dicts;
- guard.py: micro_backward / optimizer_step behind the numerical guard;
- collectives.py: all_sum, all_max, any_rank, gather_objects, barrier; dead-peer errors;
  teardowns run before the process group goes (`before_destroy`);
- lockstep.py: forward-only loops over each rank's share in lock-step (`lockstep_map`,
  `strided_map`), the one way every evaluation and scoring loop runs;
- training_state.py: full state dicts and gradients, world-size independent checkpoints;
- inference.py: frozen models, the generation context, training steps' weights, loading
  outside ZeRO-3;
- zero3.py: a ZeRO-3 model's weights gathered whole in one collective, per-module hooks off;
- trackers.py: W&B / TensorBoard / trackio through Accelerate;
- process_exit.py: ending a process that made a gloo group without the interpreter's
  teardown (which can abort or hang a finished rank);
- runtime.py: the `Runtime` facade.
"""

from __future__ import annotations

from rlhf_dist.distributed.backend import Backend, seed_everything
from rlhf_dist.distributed.collectives import before_destroy, collective_failure
from rlhf_dist.distributed.guard import NumericalGuard, TrainingDiverged
from rlhf_dist.distributed.lockstep import lockstep_map, strided_map
from rlhf_dist.distributed.runtime import Runtime

__all__ = [
    "Backend",
    "before_destroy",
    "NumericalGuard",
    "Runtime",
    "TrainingDiverged",
    "collective_failure",
    "lockstep_map",
    "seed_everything",
    "strided_map",
]
