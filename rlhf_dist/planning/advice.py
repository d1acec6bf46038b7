"""What to change when a plan does not fit, and how a plan is printed.

`find_fix` tries the changes users reach for (field notes: TRL #2719), cheapest first,
keeping each that lowers the binding phase, until the plan fits: the head in chunks,
frozen models partitioned, gradient checkpointing, a smaller micro-batch (the largest that
fits) or token budget, fewer rollout rows per forward, LoRA, then the launch (ZeRO-3,
optimizer offload). Each change is config `key=value` overrides a user can paste, or a
launch flag; unneeded ones are dropped again at the end.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlhf_dist.config import Config, apply_override, config_from_dict, sizes, to_dict, validate
from rlhf_dist.errors import ConfigError
from rlhf_dist.planning.memory import GIB, ModelShape
from rlhf_dist.planning.plan import Hardware, Plan, Shapes, build_plan, checkpointing


@dataclass(frozen=True)
class Fix:
    """Config overrides and launch settings (ZeRO stage, offload) that make a plan fit."""

    overrides: tuple[str, ...] = ()
    launch: tuple[tuple[str, Any], ...] = ()

    def text(self) -> str:
        flags = [f"--{k.replace('_', '-')} {v}" for k, v in self.launch]
        parts = list(self.overrides) + ([f"launch with {' '.join(flags)}"] if flags else [])
        return " ".join(parts)


def with_overrides(cfg: Config, overrides: tuple[str, ...]) -> Config:
    """A new frozen Config: `cfg` with `section.key=value` overrides applied."""
    tree = to_dict(cfg)
    for o in overrides:
        tree = apply_override(tree, o)
    return config_from_dict(tree)


def applied(cfg: Config, hw: Hardware, fix: Fix) -> tuple[Config, Hardware]:
    return with_overrides(cfg, fix.overrides), dataclasses.replace(hw, **dict(fix.launch))


Step = Callable[[Config, str, Shapes, Hardware], tuple[str, ...]]


def _chunk_head(cfg: Config, stage: str, shapes: Shapes, hw: Hardware) -> tuple[str, ...]:
    return ("perf.logprob_chunk_tokens=512",) if cfg.perf.logprob_chunk_tokens == 0 else ()


def _partition_frozen(cfg: Config, stage: str, shapes: Shapes, hw: Hardware) -> tuple[str, ...]:
    if hw.zero_stage == 3 and cfg.distributed.frozen_models in ("auto", "replicate"):
        return ("distributed.frozen_models=partition",)
    return ()


def _no_gather(cfg: Config, stage: str, shapes: Shapes, hw: Hardware) -> tuple[str, ...]:
    """ZeRO-3 without the one-collective full copies (generation, training); FSDP2 without
    the whole actor for generation (it never gathers the whole model for training)."""
    if hw.fsdp2 and cfg.perf.gather_for_generation:
        return ("perf.gather_for_generation=false",)
    if hw.zero_stage != 3:
        return ()
    out = ("perf.gather_for_generation=false",) if cfg.perf.gather_for_generation else ()
    return out + (
        ("perf.gather_for_training=never",) if cfg.perf.gather_for_training != "never" else ()
    )


def _hf_backend(cfg: Config, stage: str, shapes: Shapes, hw: Hardware) -> tuple[str, ...]:
    """Our decode loop instead of a vLLM engine whose copy of the actor does not fit
    (with it, no TIS correction: there is no second sampler), under ZeRO-3 through its
    per-layer fetches: a gathered copy (with LoRA, merged copies too) is what did not fit.
    Pruning puts the gather back when the plan fits with it."""
    if stage != "ppo" or cfg.generation.backend != "vllm":
        return ()
    correction = ("ppo.rollout_correction=none",) if cfg.ppo.rollout_correction != "none" else ()
    layers = hw.sharded and cfg.perf.gather_for_generation
    return ("generation.backend=hf",) + correction + (("perf.gather_for_generation=false",) if layers else ())  # fmt: skip


def _checkpoint(cfg: Config, stage: str, shapes: Shapes, hw: Hardware) -> tuple[str, ...]:
    return () if checkpointing(cfg, hw) else ("model.gradient_checkpointing=true",)


def _micro_batch(cfg: Config, stage: str, shapes: Shapes, hw: Hardware) -> tuple[str, ...]:
    """The largest micro-batch (a divisor of the rank's share, so validation holds) or
    token budget (halved) whose plan fits; the smallest when none does."""
    section = getattr(cfg, stage)
    if section.micro_batch_tokens:
        budget = section.micro_batch_tokens
        while budget > 1 and not _fits(cfg, stage, shapes, hw, f"{stage}.micro_batch_tokens={budget}"):  # fmt: skip
            budget //= 2
        return (f"{stage}.micro_batch_tokens={budget}",)
    share = max(1, per_rank_share(cfg, stage, hw))
    now = sizes.micro_batch_size(section.micro_batch_size, global_batch(cfg, stage), hw.gpus)
    options = [d for d in range(now, 0, -1) if share % d == 0]
    best = next((d for d in options if _fits(cfg, stage, shapes, hw, f"{stage}.micro_batch_size={d}")), 1)  # fmt: skip
    return (f"{stage}.micro_batch_size={best}",) if best != now else ()


def _rollout_rows(cfg: Config, stage: str, shapes: Shapes, hw: Hardware) -> tuple[str, ...]:
    if stage != "ppo":
        return ()
    rows = cfg.ppo.rollout_micro_batch_size
    while rows > 1 and not _fits(cfg, stage, shapes, hw, f"ppo.rollout_micro_batch_size={rows}"):
        rows //= 2
    return (f"ppo.rollout_micro_batch_size={rows}",) if rows != cfg.ppo.rollout_micro_batch_size else ()  # fmt: skip


def _sequence_parallel(cfg: Config, stage: str, shapes: Shapes, hw: Hardware) -> tuple[str, ...]:
    """The smallest distributed.sequence_parallel_size (2, 4, 8, ...) that dividing the GPUs
    and the policy's attention heads makes the plan fit; the largest such when none does
    (validation decides later whether the stage can split)."""
    n = cfg.distributed.sequence_parallel_size
    options = [k for k in (2, 4, 8, 16, 32, 64) if k > n and hw.gpus % k == 0]
    options = [k for k in options if shapes.policy.heads % k == 0]
    for k in options:
        if _fits(cfg, stage, shapes, hw, f"distributed.sequence_parallel_size={k}"):
            return (f"distributed.sequence_parallel_size={k}",)
    return (f"distributed.sequence_parallel_size={options[-1]}",) if options else ()


def _lora(cfg: Config, stage: str, shapes: Shapes, hw: Hardware) -> tuple[str, ...]:
    """LoRA on the actor, and on a critic that starts from the reward model."""
    if stage not in ("ppo", "dpo", "kto") or cfg.lora.enabled:
        return ()
    critic = stage == "ppo" and sizes.has_critic(cfg)
    both = critic and cfg.ppo.critic_init == "reward" and bool(shapes.reward)
    return ("lora.enabled=true",) + (("lora.critic=true",) if both else ())


def global_batch(cfg: Config, stage: str) -> int:
    """Sequences (rows) per optimizer step over all ranks."""
    if stage == "ppo":
        p = cfg.ppo
        return sizes.ppo_minibatch_size(p.minibatch_size, p.rollout_batch_size, p.samples_per_prompt)  # fmt: skip
    return getattr(cfg, stage).batch_size


def per_rank_share(cfg: Config, stage: str, hw: Hardware) -> int:
    return global_batch(cfg, stage) // hw.gpus


def _fits(cfg: Config, stage: str, shapes: Shapes, hw: Hardware, override: str) -> bool:
    return build_plan(with_overrides(cfg, (override,)), stage, shapes, hw).fits


CONFIG_STEPS: tuple[Step, ...] = (
    _chunk_head, _partition_frozen, _no_gather, _checkpoint, _micro_batch, _rollout_rows,
    _sequence_parallel, _lora, _hf_backend,
)  # fmt: skip


def launch_steps(hw: Hardware) -> list[tuple[str, Any]]:
    """Launch changes, after every config change: ZeRO-3 over several GPUs (DeepSpeed
    ZeRO-2 on one), then the optimizer states offloaded to CPU memory. An FSDP2 launch
    stays FSDP2: its one offload moves the weights, gradients and optimizer states."""
    steps: list[tuple[str, Any]] = []
    if hw.fsdp2:
        return [("offload", "all")] if hw.offload == "none" else []
    if hw.gpus > 1 and hw.zero_stage != 3:
        steps.append(("zero_stage", 3))
    elif hw.zero_stage is None:  # one GPU: DeepSpeed for ZeRO-Offload (stage 2 + offload)
        steps.append(("zero_stage", 2))
    if hw.offload == "none":
        steps.append(("offload", "optimizer"))
    return steps


def find_fix(cfg: Config, stage: str, shapes: Shapes, hw: Hardware) -> Fix | None:
    """The changes that make the plan of `cfg` fit, or None when even all of them do not.

    Greedy: each step's change is kept when the config stays valid (`validate`) and the
    binding peak falls, until the plan fits; two passes, as one change can make another
    possible (vLLM to hf, then no whole-model gather). Then each kept change that the plan
    fits without is dropped again."""
    fix, peak = Fix(), build_plan(cfg, stage, shapes, hw).binding.total
    for _ in range(2):
        for step in CONFIG_STEPS:
            c, h = applied(cfg, hw, fix)
            trial = dataclasses.replace(fix, overrides=merged(fix.overrides, step(c, stage, shapes, h)))  # fmt: skip
            fix, peak, done = _keep_if_lower(cfg, stage, shapes, hw, fix, trial, peak)
            if done:
                return _pruned(cfg, stage, shapes, hw, fix)
    for setting in launch_steps(hw):
        trial = dataclasses.replace(fix, launch=fix.launch + (setting,))
        fix, peak, done = _keep_if_lower(cfg, stage, shapes, hw, fix, trial, peak)
        if done:
            return _pruned(cfg, stage, shapes, hw, fix)
    return None


def merged(overrides: tuple[str, ...], change: tuple[str, ...]) -> tuple[str, ...]:
    """`overrides` with `change` applied: a key set again keeps its new value only."""
    keys = {c.split("=", 1)[0] for c in change}
    return tuple(o for o in overrides if o.split("=", 1)[0] not in keys) + change


def _valid(cfg: Config, stage: str, hw: Hardware) -> bool:
    """Whether a trial config keeps the run's rules between keys (not its inputs, which
    no fix changes and the plan never reads)."""
    try:
        validate(cfg, stage, hw.gpus, inputs=False)
    except ConfigError:
        return False
    return True


def _keep_if_lower(
    cfg: Config, stage: str, shapes: Shapes, hw: Hardware, fix: Fix, trial: Fix, peak: float
) -> tuple[Fix, float, bool]:
    """(the fix to keep, its binding peak, whether it fits)."""
    if trial == fix:
        return fix, peak, False
    c, h = applied(cfg, hw, trial)
    plan = build_plan(c, stage, shapes, h)
    if plan.binding.total < peak and _valid(c, stage, h):
        return trial, plan.binding.total, plan.fits
    return fix, peak, False


def _pruned(cfg: Config, stage: str, shapes: Shapes, hw: Hardware, fix: Fix) -> Fix:
    """`fix` without the overrides and launch settings the plan fits (validly) without."""
    for item in list(fix.overrides):
        trial = dataclasses.replace(fix, overrides=tuple(o for o in fix.overrides if o != item))
        c, h = applied(cfg, hw, trial)
        if build_plan(c, stage, shapes, h).fits and _valid(c, stage, h):
            fix = trial
    for setting in list(fix.launch):
        trial = dataclasses.replace(fix, launch=tuple(s for s in fix.launch if s != setting))
        c, h = applied(cfg, hw, trial)
        if build_plan(c, stage, shapes, h).fits and _valid(c, stage, h):
            fix = trial
    return fix


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB"


def describe_hardware(hw: Hardware) -> str:
    zero = "no DeepSpeed" if hw.zero_stage is None else f"ZeRO-{hw.zero_stage}"
    zero = "FSDP2" if hw.fsdp2 else zero
    offload = "" if hw.offload == "none" else f", offload {hw.offload}"
    return f"{hw.gpus} x {gib(hw.memory)} ({zero}{offload}; {gib(hw.budget)} usable per rank)"


def describe_model(shape: ModelShape) -> str:
    """'7.6B parameters', or for a mixture of experts also those a token runs through."""
    text = f"{shape.lm_params() / 1e9:.1f}B parameters"
    if shape.moe_layers:
        moe = f"{shape.experts} experts, top-{shape.experts_per_token}"
        text += f", {shape.active_params() / 1e9:.1f}B active per token ({moe})"
    return text


def format_plan(plan: Plan, title: str) -> str:
    """The plan as a table: each phase's peak per rank, then its terms."""
    lines = [f"{title} on {describe_hardware(plan.hardware)}"]
    for phase in plan.phases:
        mark = "  <- binds" if phase is plan.binding else ""
        lines.append(f"  {phase.name:<15} {gib(phase.total):>10}{mark}")
        lines += [f"      {name:<32} {gib(b):>10}" for name, b in phase.terms if b]
    return "\n".join(lines)


def one_line(plan: Plan) -> str:
    """The plan in one line (each run prints it at start)."""
    phases = ", ".join(f"{p.name} {gib(p.total)}" for p in plan.phases)
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    return f"memory plan per rank: {phases}; {plan.binding.name} binds, {verdict} in {gib(plan.hardware.budget)}"  # fmt: skip


def verdict(cfg: Config, plan: Plan, shapes: Shapes) -> str:
    """The last line: the binding phase and its headroom, or what to change."""
    b, budget = plan.binding, plan.hardware.budget
    if plan.fits:
        return f"fits: {b.name} binds at {gib(b.total)} of {gib(budget)} ({gib(budget - b.total)} to spare)"  # fmt: skip
    fix = find_fix(cfg, plan.stage, shapes, plan.hardware)
    need = f"does not fit: {b.name} needs {gib(b.total)} per rank, {gib(budget)} usable"
    if fix is None:
        return f"{need}; no config change fits it here: more GPUs, a larger device or a smaller model"  # fmt: skip
    return f"{need}; fix: {fix.text()}"


def parse_memory(text: str) -> float:
    """'80GiB' -> bytes; GB and MB are powers of 10, GiB and MiB of 2; a bare number GiB."""
    units = {"gib": GIB, "gb": 1e9, "mib": 2**20, "mb": 1e6, "tib": 2**40, "tb": 1e12, "": GIB}
    t = text.strip().lower().replace(" ", "")
    number = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(number) :]
    try:
        value = float(number)
    except ValueError:
        value = float("nan")
    if unit not in units or not value > 0:
        raise ConfigError(f"--gpu-memory: {text!r} is not a size like 80GiB or 80GB")
    return value * units[unit]


def hardware(gpus: int, memory: str, zero_stage: str, offload: str, device: str, engine: str = "deepspeed") -> Hardware:  # fmt: skip
    """The Hardware of `rlhf-dist plan`'s flags (zero_stage auto: 3 with several GPUs;
    engine fsdp2: an FSDP2 accelerate config, no DeepSpeed, offload none or all)."""
    if gpus < 1:
        raise ConfigError(f"--gpus: {gpus} (at least 1)")
    if engine == "fsdp2":
        if zero_stage != "auto":
            raise ConfigError("--zero-stage: a DeepSpeed setting; --engine fsdp2 has none")
        if offload == "optimizer":
            raise ConfigError("--offload optimizer: FSDP2 offloads all (fsdp_offload_params)")
        return Hardware(gpus, parse_memory(memory), None, offload, device, fsdp2=True)
    if zero_stage == "auto":
        zero_stage = "3" if gpus > 1 else "none"
    stage = None if zero_stage == "none" else int(zero_stage)
    if offload != "none" and stage is None:
        raise ConfigError("--offload: needs DeepSpeed (--zero-stage 1, 2 or 3)")
    if offload == "all" and stage != 3:
        raise ConfigError("--offload all: offloads weights under ZeRO-3 only (--zero-stage 3)")
    return Hardware(gpus, parse_memory(memory), stage, offload, device)


def cli_plan(cfg: Config, stage: str, gpus: int, memory: str, zero: str, offload: str, device: str, engine: str = "deepspeed") -> str:  # fmt: skip
    """`rlhf-dist plan`: the printed plan; a plan that does not fit raises ConfigError
    with the one-line fix, after the table is printed. It asks only for what it reads:
    the config's own rules are checked, not its data, reward source or packages."""
    import sys

    from rlhf_dist.config import validate
    from rlhf_dist.planning.shapes import read_shapes

    hw = hardware(gpus, memory, zero, offload, device, engine)
    validate(cfg, stage, hw.gpus, inputs=False)  # the run's rules first: a plan of a valid config
    shapes = read_shapes(cfg, stage)
    plan = build_plan(cfg, stage, shapes, hw)
    title = f"rlhf-dist plan: {stage}, policy {cfg.model.policy or cfg.model.reward}"
    title += f" ({describe_model(shapes.policy)})"
    last = verdict(cfg, plan, shapes)
    if plan.fits:
        return format_plan(plan, title) + "\n" + last
    print(format_plan(plan, title), flush=True)
    sys.stdout.flush()
    raise ConfigError(last)
