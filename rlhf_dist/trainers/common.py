"""Pieces every trainer shares: run directory, optimizer and schedule, final export."""

from __future__ import annotations

import math
import signal
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
from torch import nn

from rlhf_dist.checkpoint import (
    Checkpoint,
    find_checkpoint,
    maybe_fault,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from rlhf_dist.config import (
    Config,
    DPOConfig,
    KTOConfig,
    ModelConfig,
    OptimConfig,
    RMConfig,
    SFTConfig,
    to_dict,
)
from rlhf_dist.data.batching import global_batches, stage_plan
from rlhf_dist.data.vision import VisionInputs
from rlhf_dist.distributed import Runtime
from rlhf_dist.errors import Preempted, TrainingDiverged  # noqa: F401 (Preempted re-exported)
from rlhf_dist.models import (
    DTYPES,
    enable_gradient_checkpointing,
    sub_state_dict,
    train_dtype,
    upcast_trainable,
    uses_checkpointing,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rlhf_dist.data.batching import BatchPlan
    from rlhf_dist.observability.tracking import MetricsLogger

# What a step loop trains: the prepared model, its optimizer and its LambdaLR schedule.
Trained: TypeAlias = tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]
# An optimizer step's examples: (epoch, global indices into the stage's examples).
GlobalBatch: TypeAlias = tuple[int, list[int]]
# A stage's held-out evaluation: {name: number}, every rank calling it (its forwards are
# in lock-step); None where the stage has no held-out data.
Evaluate: TypeAlias = Callable[[], dict[str, float]] | None

# The section of a step-loop stage: the shared StageConfig keys and the stage's own `optim`.
StepSection = SFTConfig | RMConfig | DPOConfig | KTOConfig


class PreemptionFlag:
    """Remembers a SIGTERM (cluster preemption) until the loop reaches a safe point."""

    def __init__(self) -> None:
        self.received = False
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        """The SIGTERM handler: only note it; the loop checkpoints at its next safe point."""
        self.received = True

    def any_rank(self, runtime: Runtime) -> bool:
        """True on every rank if any rank got SIGTERM (they must checkpoint together)."""
        flag = torch.tensor(float(self.received))
        return bool(runtime.all_max(flag) > 0)


def find_resume(cfg: Config, runtime: Runtime) -> Checkpoint | None:
    """The checkpoint this run continues from (run.resume), loaded; None for a fresh run."""
    path = find_checkpoint(cfg.run.resume, Path(cfg.run.output_dir))
    return Checkpoint(path, runtime, runtime.read_training_state) if path else None


def safe_point(
    cfg: Config,
    runtime: Runtime,
    out: Path,
    steps: tuple[int, int],
    preemption: PreemptionFlag,
    trained: tuple[Any, Any],
    trainer_state: dict,
) -> None:
    """After a step (SFT/RM) or iteration (PPO): checkpoint when due, on SIGTERM, or when
    the numerical guard gives up; then stop if either happened.

    steps: (this step, last step); trained: (model, optimizer); trainer_state: the
    plain-data state to save. Skipped steps never touched the weights, so the checkpoint
    written on divergence holds the last good state.
    """
    step, last = steps
    preempted = preemption.any_rank(runtime)
    diverged = runtime.bad_steps_in_row >= cfg.run.max_bad_steps
    if checkpoint_due(cfg, step, last, preempted or diverged):
        write_checkpoint(cfg, runtime, out, step, *trained, trainer_state)
    if diverged:
        raise TrainingDiverged(
            f"{runtime.bad_steps_in_row} optimizer steps in a row had a non-finite loss or gradient "
            f"and were skipped (run.max_bad_steps={cfg.run.max_bad_steps}); the last good state "
            f"is checkpointed at step {step} in {out / 'checkpoints'}"
        )
    if preempted:
        raise Preempted(f"SIGTERM: checkpoint written at step {step}; resume with --resume auto")


def checkpoint_due(cfg: Config, step: int, last_step: int, preempted: bool) -> bool:
    """Whether to checkpoint after `step`: on preemption or divergence, every
    run.checkpoint_every steps, and at the last step (with checkpoints on)."""
    every = cfg.run.checkpoint_every
    return preempted or (every > 0 and (step % every == 0 or step == last_step))


def write_checkpoint(
    cfg: Config,
    runtime: Runtime,
    out: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict,
) -> None:
    """Write an atomic checkpoint of the world-size independent training state: gathered
    whole, or under FSDP2 each rank's shards (distributed/training_state.py)."""
    shards = runtime.sharded_state_writer(model, optimizer)
    state = None if shards else runtime.gather_training_state(model, optimizer)
    # The effective config rides along, so a checkpoint says what produced it.
    trainer_state = trainer_state | {"config": to_dict(cfg)}
    keep = cfg.run.keep_checkpoints
    save_checkpoint(runtime, out / "checkpoints", step, state, trainer_state, keep, shards)


def make_optimizer(
    groups: Sequence[tuple[Iterable[nn.Parameter], OptimConfig]],
) -> torch.optim.Optimizer:
    """AdamW with one param group per (parameters, OptimConfig) pair, each its own lr/eps."""
    param_groups = [
        {
            "params": [p for p in params if p.requires_grad],
            "lr": optim.lr,
            "weight_decay": optim.weight_decay,
            "eps": optim.adam_eps,
        }
        for params, optim in groups
    ]
    # fused: one kernel per step instead of ~10 per parameter tensor (the optimizer step
    # is a visible share of a small model's iteration); supported on CPU and CUDA alike.
    return torch.optim.AdamW(param_groups, betas=(0.9, 0.999), fused=True)


def make_scheduler(
    optimizer: torch.optim.Optimizer, optim_cfgs: list[OptimConfig], total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR per param group: linear warmup, then constant, linear or cosine decay to 0."""

    def factor(cfg: OptimConfig) -> Callable[[int], float]:
        def f(step: int) -> float:
            if step < cfg.warmup_steps:
                return (step + 1) / cfg.warmup_steps
            progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
            if cfg.schedule == "linear":
                return 1.0 - progress
            if cfg.schedule == "cosine":
                return 0.5 * (1.0 + math.cos(math.pi * progress))
            return 1.0

        return f

    return torch.optim.lr_scheduler.LambdaLR(optimizer, [factor(c) for c in optim_cfgs])


def save_pretrained(
    runtime: Runtime,
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    directory: Path,
    submodule: str = "",
    dtype: str = "float32",
) -> None:
    """Write an HF-format model + tokenizer (safetensors) that from_pretrained loads.

    model: the prepared model; submodule: dotted path inside it of the transformers model
    to save (e.g. "actor", "critic.classifier"); dtype: model.dtype, the dtype of the
    export (fp32 master weights of a bf16 run are exported in bf16, the precision the user
    asked for). Under ZeRO-3 the full 16-bit weights are gathered first (every rank must
    call this).
    """
    state = runtime.full_state_dict(model)
    if runtime.is_main:
        assert state is not None  # Runtime.full_state_dict gives it to the main process
        target, prefix = runtime.unwrap(model), ""
        for name in filter(None, submodule.split(".")):
            target, prefix = getattr(target, name), prefix + name + "."
        own = {
            k: v.to(DTYPES[dtype]) if v.is_floating_point() else v
            for k, v in sub_state_dict(state, prefix).items()
        }
        directory.mkdir(parents=True, exist_ok=True)
        target.save_pretrained(directory, state_dict=own, safe_serialization=True)
        tokenizer.save_pretrained(directory)
    runtime.barrier()


def save_processor(runtime: Runtime, vision: VisionInputs | None, directories: list[Path]) -> None:
    """A vision-language policy's processor (image processor, chat template) saved next to
    its exported weights, so the next stage and `from_pretrained` users load it; nothing
    for a text policy. Called before the tokenizer is saved there: the run's tokenizer
    (export_tokenizer) replaces the processor's copy. Main process only. A Qwen-VL
    processor without its video half is saved under its real class (models/qwen_vl.py)."""
    from rlhf_dist.models.qwen_vl import save_any

    if vision is None or not runtime.is_main:
        return
    for directory in directories:
        save_any(vision.processor, directory)


def resume_into(
    runtime: Runtime,
    ckpt: Checkpoint,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    seed: int,
) -> None:
    """After `prepare`: restore optimizer moments, the schedule and this rank's RNG.

    (The weights were copied in before `prepare` with ckpt.load_weights_into; under FSDP2
    a sharded checkpoint's weights are read here, into the shards, with the moments.)
    """
    runtime.restore_optimizer_state(model, optimizer, ckpt.training, ckpt.shards)
    scheduler.load_state_dict(ckpt.trainer["scheduler"])
    ckpt.restore_rng(seed)


DISTRIBUTIONS = "_distributions"  # key of a step's per-example values in step_fn's result
EVAL_CONSOLE = ("eval/loss", "eval/accuracy", "eval/score", "eval/kl_to_ref")


def evaluate_if_due(
    cfg: Config,
    runtime: Runtime,
    logger: MetricsLogger,
    steps: tuple[int, int],
    evaluate: Evaluate,
) -> dict:
    """run.eval_every: every N optimizer steps (SFT/RM/DPO/KTO) or iterations (PPO), and at
    the last one, run the stage's held-out evaluation and log it as eval/<name> with the
    step (docs/metrics.md); returns what was logged ({} when not due).

    steps: (this step, last step); evaluate() -> {name: number}, the stage's own held-out
    evaluation (its forwards in lock-step: every rank must call this), or None without
    held-out data. The RNG streams are put back afterwards: the training run draws the
    same numbers with the evaluation as without it."""
    step, last = steps
    every = cfg.run.eval_every
    if evaluate is None or every <= 0 or not (step % every == 0 or step == last):
        return {}
    state = rng_state()
    metrics = {f"eval/{name}": value for name, value in evaluate().items()}
    set_rng_state(state)
    logger.log(step, metrics, EVAL_CONSOLE)
    return metrics


def step_loop(
    cfg: Config,
    runtime: Runtime,
    out: Path,
    logger: MetricsLogger,
    ckpt: Checkpoint | None,
    trained: Trained,
    batches: Sequence[GlobalBatch],
    step_fn: Callable[[list[int]], dict[str, Any]],
    stage: str,
    console: tuple[str, ...],
    evaluate: Evaluate = None,
) -> dict:
    """The SFT/RM/DPO/KTO loop: skip to the checkpoint, step, log, checkpoint, stop on
    SIGTERM, evaluate when due (`evaluate_if_due`; evaluate: the stage's held-out evaluation
    or None).

    trained: (model, optimizer, scheduler); batches: list of (epoch, global indices);
    step_fn(indices) runs one optimizer step and returns its metrics, with this rank's
    per-example values under DISTRIBUTIONS: every run.histogram_every steps they are
    gathered from all ranks and logged as histograms (a collective: all ranks take part).
    """
    model, optimizer, scheduler = trained
    start, total = (ckpt.step if ckpt else 0), len(batches)
    preemption = PreemptionFlag()
    metrics: dict[str, Any] = {}
    for step, (epoch, idx) in enumerate(batches, 1):
        if step <= start:
            continue  # done before the checkpoint; the order is a function of the seed
        # ZeRO-3: the weights gathered whole for the step when a copy fits.
        with runtime.training_weights(model, cfg.perf.gather_for_training, stage):
            metrics = step_fn(idx)
        metrics |= {
            "guard/skipped_steps": runtime.skipped_steps,
            f"{stage}/epoch": epoch,
            f"{stage}/lr": scheduler.get_last_lr()[0],
        }
        values = metrics.pop(DISTRIBUTIONS, {})
        if cfg.run.histogram_every > 0 and (step % cfg.run.histogram_every == 0 or step == total):
            gathered = {
                k: torch.tensor(runtime.gather_objects(v.tolist())) for k, v in values.items()
            }
            metrics |= logger.log_distributions(step, gathered)
        maybe_fault("update", step)
        if step % cfg.run.log_every == 0 or step == total:
            logger.log(step, metrics, console)
        state = {"scheduler": scheduler.state_dict()}
        safe_point(cfg, runtime, out, (step, total), preemption, (model, optimizer), state)
        evaluate_if_due(cfg, runtime, logger, (step, total), evaluate)
    return metrics


def finish_trainable(
    net: torch.nn.Module, model_cfg: ModelConfig, deepspeed: bool
) -> torch.nn.Module:
    """The trained model as the precision table says (docs/distributed.md): without
    DeepSpeed its trainable parameters in fp32 (bf16 is the autocast's compute dtype);
    with model.gradient_checkpointing, activations recomputed in backward."""
    if not deepspeed:
        upcast_trainable(net)
    if uses_checkpointing(model_cfg):
        enable_gradient_checkpointing(net)
    return net


def prepare_single_model(
    cfg: Config,
    runtime: Runtime,
    net: nn.Module,
    section: StepSection,
    n_examples: int,
    ckpt: Checkpoint | None,
) -> tuple[Trained, BatchPlan, list[GlobalBatch]]:
    """Plan, global batches and the prepared (model, optimizer, scheduler) of an SFT or RM
    run whose config section is `section`; resumed from `ckpt` if given."""
    finish_trainable(net, cfg.model, deepspeed=runtime.zero_stage is not None)
    if ckpt:
        ckpt.load_weights_into(net)  # before prepare: every backend partitions these
    plan = stage_plan(section, runtime.world_size)
    batches = list(global_batches(n_examples, section.batch_size, cfg.run.seed, section.epochs))
    optimizer = make_optimizer([(net.parameters(), section.optim)])
    scheduler = make_scheduler(optimizer, [section.optim], len(batches))
    accumulation, clip = plan.accumulation_steps, section.optim.max_grad_norm
    model, optimizer = runtime.prepare(
        net, optimizer, plan.micro_batch_size, accumulation, clip, train_dtype(cfg.model)
    )
    if ckpt:
        resume_into(runtime, ckpt, model, optimizer, scheduler, cfg.run.seed)
    model.train()
    return (model, optimizer, scheduler), plan, batches


def step_and_schedule(
    runtime: Runtime, trained: Trained, max_grad_norms: list[float]
) -> list[float] | None:
    """Clip, step the optimizer and the schedule; returns the pre-clip gradient norm of
    each param group (one max norm each, e.g. [actor, critic]), or None if the numerical
    guard skipped the step (the schedule advances either way).

    trained: (model, optimizer, scheduler).
    """
    model, optimizer, scheduler = trained
    norms = runtime.optimizer_step(model, optimizer, max_grad_norms)
    scheduler.step()
    return norms


def share_of_global_mean(
    runtime: Runtime, loss_sum: torch.Tensor, global_count: int | torch.Tensor
) -> torch.Tensor:
    """The loss to backward for one micro-batch: loss_sum x world_size / global_count.

    loss_sum: 0-dim SUM of this micro-batch's per-token (or per-pair) losses on this rank;
    global_count: how many tokens (pairs) the WHOLE optimizer step has over ALL ranks.
    Data-parallel backends AVERAGE gradients over ranks, so the x world_size undoes that
    average; dividing by the global count makes the accumulated gradient the gradient of
    the step's global mean loss, the same however the batch is split into ranks and
    micro-batches (a per-micro-batch mean would weight tokens of short batches more).
    With sequence parallelism the n ranks of a group each compute this same loss of a
    pooled micro-batch; the gradient reaching each rank's columns is the average of the n
    (distributed/sequence_parallel.py `gather_columns`), so nothing changes here.
    """
    return loss_sum * runtime.world_size / global_count


def padding_cells(attention_mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(padding cells, all cells) of one padded (B, L) batch: the `<stage>/pad_fraction`
    sums (docs/metrics.md), reduced over ranks by a StatSums like every logged mean."""
    return attention_mask.numel() - attention_mask.sum(), attention_mask.numel()
