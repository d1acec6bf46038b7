"""The plan at the start of every run (api.run): one printed line, a GPU run that cannot
fit refused before any model loads (exit 2, with the fix), and `run.auto_fit`'s derived
config: the largest micro-batches that fit, a new frozen Config (config is never written
to at run time)."""

from __future__ import annotations

from typing import Any, Protocol

from rlhf_dist.config import Config, sizes
from rlhf_dist.errors import ConfigError
from rlhf_dist.planning.advice import global_batch, one_line, verdict, with_overrides
from rlhf_dist.planning.plan import Hardware, Shapes, build_plan
from rlhf_dist.planning.shapes import read_shapes

PLANNED_STAGES = ("sft", "rm", "ppo", "dpo", "kto")


class RunMachine(Protocol):
    """What the planner reads of a run's distributed.Runtime (by its attributes: planning
    imports no runtime)."""

    @property
    def world_size(self) -> int: ...
    @property
    def zero_stage(self) -> int | None: ...
    @property
    def zero_offload(self) -> str: ...
    @property
    def engine(self) -> str: ...  # zero0..zero3, fsdp2, ddp or single
    @property
    def device(self) -> Any: ...  # a torch.device: its .type
    def device_memory_bytes(self) -> int: ...


def run_hardware(runtime: RunMachine) -> Hardware:
    """The planner's view of a run's machine from its distributed.Runtime (read by its
    attributes: planning imports no runtime): ranks, one rank's memory, the launch's ZeRO
    stage and offload, the device kind, whether it is an FSDP2 launch."""
    fsdp2 = runtime.engine == "fsdp2"
    return Hardware(
        runtime.world_size,
        runtime.device_memory_bytes(),
        runtime.zero_stage,
        runtime.zero_offload,
        "cuda" if runtime.device.type == "cuda" else "cpu",
        fsdp2,
    )


def plan_at_start(cfg: Config, stage: str, hw: Hardware) -> tuple[Config, list[str]]:
    """(the config the run uses, the lines to print). Refuses (ConfigError) a plan that
    does not fit a GPU; on CPU, where ranks share the host's memory with everything else,
    the plan is printed only. A model whose config.json cannot be read is left to the
    loader, which names the key."""
    if stage not in PLANNED_STAGES:
        return cfg, []
    try:
        shapes = read_shapes(cfg, stage)
    except ConfigError:
        return cfg, []
    check_sequence_parallel_heads(cfg.distributed.sequence_parallel_size, shapes.policy.heads)
    lines = []
    if cfg.run.auto_fit:
        changes = auto_fit(cfg, stage, shapes, hw)
        cfg = with_overrides(cfg, changes)
        lines.append(f"run.auto_fit: {' '.join(changes) or 'the configured sizes are the largest that fit'}")  # fmt: skip
    plan = build_plan(cfg, stage, shapes, hw)
    lines.append(one_line(plan))
    if hw.device == "cuda" and not plan.fits:
        raise ConfigError(verdict(cfg, plan, shapes))
    return cfg, lines


def check_sequence_parallel_heads(size: int, heads: int | None) -> None:
    """Ulysses splits the query heads over the group: a size that does not divide the
    model's `heads` (None: unknown) is one line naming the key. Called from config.json
    before loading (`plan_at_start`) and on the loaded model by the forward
    (engine/sequence_parallel.py `check_heads`)."""
    if size > 1 and (heads is None or heads % size):
        raise ConfigError(
            f"distributed.sequence_parallel_size={size} must divide the model's {heads} attention heads"
        )


def auto_fit(cfg: Config, stage: str, shapes: Shapes, hw: Hardware) -> tuple[str, ...]:
    """Overrides with the largest micro-batch (a divisor of the rank's share of a step,
    so validation holds) or token budget (whole sequences) whose plan fits; PPO's
    rollout rows per forward likewise (a divisor of the rank's rollout). The smallest
    when none fits: the plan printed next says so."""
    section = getattr(cfg, stage)
    share = max(1, global_batch(cfg, stage) // hw.gpus)
    if section.micro_batch_tokens:
        length = cfg.data.max_length if stage != "ppo" else _ppo_length(cfg)
        options = [f"{stage}.micro_batch_tokens={n * length}" for n in range(share, 0, -1)]
    else:
        options = [f"{stage}.micro_batch_size={d}" for d in _divisors_down(share)]
    changes: tuple[str, ...] = (_largest_fitting(cfg, stage, shapes, hw, options),)
    if stage == "ppo":
        rollout = sizes.rollout_sequences_per_rank(cfg.ppo, hw.gpus)
        rows = [f"ppo.rollout_micro_batch_size={d}" for d in _divisors_down(rollout)]
        changes += (_largest_fitting(with_overrides(cfg, changes), stage, shapes, hw, rows),)
    return tuple(c for c in changes if c not in _current(cfg, stage, hw))


def _ppo_length(cfg: Config) -> int:
    return cfg.data.max_prompt_length + cfg.generation.max_new_tokens


def _divisors_down(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def _largest_fitting(cfg: Config, stage: str, shapes: Shapes, hw: Hardware, options: list[str]) -> str:  # fmt: skip
    """The first of `options` (largest first) whose plan fits, else the last."""
    for option in options:
        if build_plan(with_overrides(cfg, (option,)), stage, shapes, hw).fits:
            return option
    return options[-1]


def _current(cfg: Config, stage: str, hw: Hardware) -> set[str]:
    """The sizes as configured (resolved), as overrides: auto_fit reports only changes."""
    section = getattr(cfg, stage)
    micro = sizes.micro_batch_size(section.micro_batch_size, global_batch(cfg, stage), hw.gpus)
    now = {f"{stage}.micro_batch_size={section.micro_batch_size or micro}",
           f"{stage}.micro_batch_tokens={section.micro_batch_tokens}"}  # fmt: skip
    if stage == "ppo":
        now.add(f"ppo.rollout_micro_batch_size={cfg.ppo.rollout_micro_batch_size}")
    return now


def planned_phases(cfg: Config, stage: str, hw: Hardware) -> dict[str, float]:
    """Each phase's planned per-rank peak (bytes), for the run's metrics; {} when the
    models' config.json cannot be read."""
    try:
        shapes = read_shapes(cfg, stage)
    except ConfigError:
        return {}
    return {p.name: p.total for p in build_plan(cfg, stage, shapes, hw).phases}
