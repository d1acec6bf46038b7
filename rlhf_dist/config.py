"""Run configuration: frozen dataclasses, one per section, from YAML plus `a.b=c` overrides.

Every mistake a user can make in a config (unknown key, wrong type, a value outside its
choices, an impossible combination) raises `ConfigError` with a one-line message naming
the key, before any model is loaded. Config objects are never written to at run time;
numbers derived from them (per-rank batch sizes, accumulation steps) live in
`rlhf_dist.batching`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rlhf_dist.algo.kl import KL_KINDS
from rlhf_dist.files import atomic_write_text


class UserError(Exception):
    """A mistake of the user's (config, data, their code); the CLI prints it as one line."""


class ConfigError(UserError, ValueError):
    """A user mistake in the configuration; its message is one line naming the key."""


class RewardFunctionError(UserError, RuntimeError):
    """The user's reward function raised or returned something unusable."""


def _choices(*values: str) -> dict:
    return {"choices": values}


@dataclass(frozen=True)
class RunConfig:
    output_dir: str = "runs/default"
    seed: int = 0
    log_every: int = 1
    # Trackers besides metrics.jsonl (always written): "wandb", "tensorboard".
    trackers: tuple[str, ...] = ()
    project: str = "rlhf_dist"
    wandb_mode: str = field(default="online", metadata=_choices("online", "offline"))
    # PPO: histograms (advantages, per-token KL, scores, lengths) and a sample table every
    # N iterations (0 = never).
    histogram_every: int = 10
    samples_every: int = 10
    num_samples: int = 8
    # A progress bar with ETA on the main process (when stderr is a terminal).
    progress: bool = True
    # Save a resumable checkpoint every N optimizer steps (SFT/RM) or iterations (PPO); 0 = never
    # (a SIGTERM still writes one). Only the newest keep_checkpoints are kept.
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    # "auto": continue from <output_dir>/checkpoints/latest if there is one; or a checkpoint path.
    resume: str = ""
    # Optimizer steps with a non-finite loss or gradient are skipped (all ranks agree); this
    # many in a row stop the run with a checkpoint of the last good state.
    max_bad_steps: int = 3
    # CPU threads per process; 0 = the machine's cores divided among the local ranks
    # (oversubscribed OpenMP threads spin-wait and run 10-100x slower).
    num_threads: int = 0


@dataclass(frozen=True)
class ModelConfig:
    # Causal LM to start from (SFT input, PPO actor/reference): local dir or hub name.
    policy: str = ""
    # Sequence-classification reward model (RM output, PPO reward): local dir or hub name.
    reward: str = ""
    # Tokenizer path; empty means the policy's.
    tokenizer: str = ""
    # Weights of the trained models (actor, critic; SFT/RM model). bfloat16 under DeepSpeed
    # turns on its bf16 mixed precision (fp32 master weights in the optimizer).
    dtype: str = field(default="float32", metadata=_choices("float32", "bfloat16"))
    # Weights of the frozen reference and reward model; "auto" = model.dtype.
    frozen_dtype: str = field(default="auto", metadata=_choices("auto", "float32", "bfloat16"))
    # Run Python code shipped with a hub model (its modeling files). Off: only code we install.
    trust_remote_code: bool = False
    # Load weights from .safetensors only; false also allows pickle (.bin) checkpoints,
    # which can run arbitrary code when loaded.
    safetensors_only: bool = True
    # Attention kernel of every model (transformers' attn_implementation). "auto" keeps the
    # model's default (sdpa for most); "eager" is faster for tiny models on CPU, where a
    # fused kernel's setup costs more than the attention itself; flash_attention_2 needs
    # the flash-attn package and a GPU.
    attn_implementation: str = field(
        default="auto", metadata=_choices("auto", "eager", "sdpa", "flash_attention_2")
    )


@dataclass(frozen=True)
class DataConfig:
    # Training data: local .jsonl/.json/.parquet/.csv file, or a hub dataset name.
    train: str = ""
    # Held-out data of the same format (RM accuracy, eval prompts). Empty: none.
    eval: str = ""
    split: str = "train"
    prompt_field: str = "prompt"
    max_prompt_length: int = 64
    # Prompt + response tokens for SFT / RM sequences.
    max_length: int = 128
    # What to do with a prompt longer than max_prompt_length: keep its last tokens, or skip it.
    too_long: str = field(default="truncate", metadata=_choices("truncate", "drop"))


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-4
    weight_decay: float = 0.0
    adam_eps: float = 1e-5
    max_grad_norm: float = 1.0
    warmup_steps: int = 0
    schedule: str = field(default="constant", metadata=_choices("constant", "linear", "cosine"))


@dataclass(frozen=True)
class SFTConfig:
    epochs: int = 1
    batch_size: int = 32
    micro_batch_size: int = 32
    optim: OptimConfig = OptimConfig(lr=1e-3)


@dataclass(frozen=True)
class RMConfig:
    epochs: int = 1
    batch_size: int = 32
    micro_batch_size: int = 32
    optim: OptimConfig = OptimConfig(lr=1e-4)
    # Ranked lists (`responses` best-first) expand to all C(n, 2) pairs.
    responses_field: str = "responses"


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 32
    # EOS is suppressed until this many tokens were generated (0: no minimum).
    min_new_tokens: int = 0
    temperature: float = 0.7
    top_k: int = 0
    top_p: float = 1.0


@dataclass(frozen=True)
class RewardConfig:
    # "module:callable" taking (prompts, responses) -> list[float]; overrides model.reward.
    function: str = ""
    # Replace the score of a response without EOS by this value (N+ study uses -1).
    missing_eos_penalty: float | None = None
    # Running normalisation of scores (mean/std over all ranks, updated every iteration),
    # then clipping to [-clip, clip]; both after the missing-EOS penalty.
    normalize: bool = False
    clip: float | None = None


@dataclass(frozen=True)
class PPOConfig:
    iterations: int = 100
    # Prompts per iteration, summed over all ranks.
    rollout_batch_size: int = 64
    # Sequences per forward pass during rollout scoring and generation, per rank.
    rollout_micro_batch_size: int = 64
    ppo_epochs: int = 4
    # Sequences per optimizer step, summed over all ranks.
    minibatch_size: int = 16
    # Sequences per forward/backward pass, per rank.
    micro_batch_size: int = 16
    actor: OptimConfig = OptimConfig(lr=1e-5)
    critic: OptimConfig = OptimConfig(lr=1e-5)
    critic_init: str = field(default="reward", metadata=_choices("reward", "policy"))
    # Policy ratio clip; null turns clipping off (a debugging knob).
    clip_eps: float | None = 0.2
    value_clip_eps: float | None = 0.2
    vf_coef: float = 0.1
    gamma: float = 1.0
    lam: float = 0.95
    kl_coef: float = 0.05
    kl_kind: str = field(default="k1", metadata=_choices(*KL_KINDS))
    kl_controller: str = field(default="fixed", metadata=_choices("fixed", "adaptive"))
    kl_target: float = 6.0
    kl_horizon: float = 10000.0
    whiten_advantages: bool = True


@dataclass(frozen=True)
class EvalConfig:
    # Reference policy for the KL figure; empty means the run's model.policy has none.
    reference: str = ""
    num_prompts: int = 128
    batch_size: int = 64
    # Optional oracle `module:callable(prompts, responses, finished) -> list[float]`,
    # e.g. the demo task's gold reward, reported as gold_reward.
    gold_function: str = ""


@dataclass(frozen=True)
class AlertsConfig:
    # PPO health alerts (rlhf_dist/alerts.py), each printed once and logged as alerts/<name>.
    enabled: bool = True
    kl_max: float = 20.0  # nats per response to the reference
    length_drift: float = 0.5  # |mean length / first iteration's - 1|
    window: int = 5  # iterations over which score and KL trends are judged
    kl_rise_per_iteration: float = 1.0  # nats/iteration of KL growth while the score rises
    score_std_collapse: float = 0.8  # fall of the score std relative to the first iteration
    clipfrac_max: float = 0.3
    approx_kl_max: float = 0.1
    entropy_collapse: float = 0.7  # fall of the entropy relative to the first iteration


@dataclass(frozen=True)
class DebugConfig:
    # PPO on the SAME prompts every iteration: the score must climb, or something is broken.
    overfit_one_batch: bool = False
    # Print the first rollout batch decoded token by token with its masks.
    print_first_batch: bool = False


@dataclass(frozen=True)
class LoRAConfig:
    # LoRA adapters (peft) on the actor; the reference is the same base with adapters
    # disabled, so the base weights are held once. LoRA dropout is always 0 (dropout off).
    enabled: bool = False
    r: int = 16
    alpha: int = 32
    target_modules: tuple[str, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    # Adapters on the critic too (its value head stays fully trainable). With the critic
    # initialised from the reward model, the frozen reward model is that same base with
    # adapters disabled: one copy of the reward model's weights.
    critic: bool = False
    # What `final/` holds for a LoRA actor: the merged model, and/or the adapter in final_adapter/.
    export: str = field(default="both", metadata=_choices("merged", "adapter", "both"))


@dataclass(frozen=True)
class DistributedConfig:
    # Frozen reference / reward model: "partition" them like ZeRO-3 (inference engines),
    # "replicate" a full copy per rank, "offload" their partitions to CPU memory;
    # "auto" = partition under ZeRO-3, replicate otherwise.
    frozen_models: str = field(
        default="auto", metadata=_choices("auto", "partition", "replicate", "offload")
    )
    # Under ZeRO-3, gather the actor's full weights once per rollout for generation (fast;
    # needs memory for one full copy). Off: generate through ZeRO-3's per-layer gathers.
    gather_for_generation: bool = True
    # Seconds a collective waits for the other ranks before the run fails with an error.
    timeout_s: int = 1800


@dataclass(frozen=True)
class Config:
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    sft: SFTConfig = SFTConfig()
    rm: RMConfig = RMConfig()
    ppo: PPOConfig = PPOConfig()
    generation: GenerationConfig = GenerationConfig()
    reward: RewardConfig = RewardConfig()
    eval: EvalConfig = EvalConfig()
    lora: LoRAConfig = LoRAConfig()
    alerts: AlertsConfig = AlertsConfig()
    debug: DebugConfig = DebugConfig()
    distributed: DistributedConfig = DistributedConfig()


# ---------------------------------------------------------------------------- building


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_optional(tp: Any) -> tuple[bool, Any]:
    """(True, inner) for `X | None`; (False, tp) otherwise."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return True, args[0]
    return False, tp


def _parse_scalar(text: str) -> Any:
    """A command-line value as YAML would read it (`1`, `true`, `null`, `[a, b]`, text)."""
    try:
        return yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return text


def _coerce(value: Any, tp: Any, key: str) -> Any:
    optional, inner = _is_optional(tp)
    if value is None or (optional and isinstance(value, str) and value.lower() in ("null", "none")):
        if optional:
            return None
        raise ConfigError(f"{key}: must not be null")
    if inner is bool:
        if isinstance(value, bool):
            return value
    elif inner is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif inner is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-5" as text
            try:
                return float(value)
            except ValueError:
                pass
    elif inner is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    elif typing.get_origin(inner) is tuple:
        items = [value] if isinstance(value, str) else value
        if isinstance(items, (list, tuple)) and all(isinstance(v, str) for v in items):
            return tuple(v for v in items if v)
    name = getattr(inner, "__name__", str(inner))
    raise ConfigError(f"{key}: expected {name}, got {value!r} ({type(value).__name__})")


def _build(cls: type, data: dict, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {data!r}")
    hints = _hints(cls)
    names = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in names:
            known = ", ".join(sorted(names))
            raise ConfigError(f"{full}: unknown key (known here: {known})")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            default = names[key].default
            base = dataclasses.asdict(default) if dataclasses.is_dataclass(default) else {}
            kwargs[key] = _build(tp, _deep_merge(base, value, full), f"{full}.")
        else:
            kwargs[key] = _coerce(value, tp, full)
            choices = names[key].metadata.get("choices")
            if choices and kwargs[key] not in choices:
                raise ConfigError(f"{full}: must be one of {', '.join(choices)}, got {value!r}")
    return cls(**kwargs)


def _deep_merge(base: dict, extra: Any, key: str) -> dict:
    if not isinstance(extra, dict):
        raise ConfigError(f"{key}: expected a mapping, got {extra!r}")
    out = dict(base)
    for k, v in extra.items():
        out[k] = _deep_merge(out[k], v, f"{key}.{k}") if isinstance(out.get(k), dict) else v
    return out


def apply_override(tree: dict, override: str) -> dict:
    """Return a copy of `tree` with one `a.b.c=value` override applied."""
    if "=" not in override:
        raise ConfigError(f"{override}: overrides look like section.key=value")
    dotted, text = override.split("=", 1)
    parts = dotted.strip().split(".")
    if not all(parts):
        raise ConfigError(f"{dotted}: overrides look like section.key=value")
    out = dict(tree)
    node = out
    for part in parts[:-1]:
        child = node.get(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: {part} is not a section")
        node[part] = dict(child)
        node = node[part]
    node[parts[-1]] = _parse_scalar(text)
    return out


def load_config(path: str | os.PathLike | None = None, overrides: list[str] = ()) -> Config:
    """Config from a YAML file (safe-loaded) and `section.key=value` overrides, in order."""
    tree: dict = {}
    if path:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"--config {path}: cannot read ({e.strerror})") from None
        except UnicodeDecodeError:
            raise ConfigError(f"--config {path}: cannot read (not UTF-8 text)") from None
        try:
            tree = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            where = getattr(e, "problem_mark", None)
            line = f" at line {where.line + 1}" if where else ""
            raise ConfigError(f"--config {path}: invalid YAML{line}") from None
        if not isinstance(tree, dict):
            raise ConfigError(
                f"--config {path}: expected a mapping of sections, got {type(tree).__name__}"
            )
    for override in overrides:
        tree = apply_override(tree, override)
    return config_from_dict(tree)


def config_from_dict(tree: dict) -> Config:
    return _build(Config, tree, "")


def to_dict(cfg: Any) -> dict:
    """Plain nested dict (tuples become lists) for YAML/JSON output."""

    def plain(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v

    return plain(dataclasses.asdict(cfg))


def save_config(cfg: Config, output_dir: str | os.PathLike) -> Path:
    """Write the effective config to `<output_dir>/config.yaml` (atomically) and return its path."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(out / "config.yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False))


# -------------------------------------------------------------------------- validation


def _positive(cfg: Any, prefix: str, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not (value > 0 and math.isfinite(value)):  # also rejects NaN and inf
            raise ConfigError(f"{prefix}.{name}: must be > 0, got {value}")


def _divides(small: tuple[str, int], big: tuple[str, int]) -> None:
    if big[1] % small[1]:
        raise ConfigError(f"{small[0]}={small[1]} must divide {big[0]}={big[1]}")


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def validate(cfg: Config, stage: str, world_size: int = 1) -> None:
    """Check the keys `stage` ("sft", "rm", "ppo", "eval") uses; raise ConfigError naming one."""
    _positive(cfg.run, "run", "log_every")
    _positive(cfg.distributed, "distributed", "timeout_s")
    _positive(cfg.run, "run", "max_bad_steps", "num_samples")
    if cfg.run.histogram_every < 0 or cfg.run.samples_every < 0:
        raise ConfigError("run.histogram_every and run.samples_every must be >= 0")
    if cfg.run.checkpoint_every < 0 or cfg.run.keep_checkpoints < 1:
        raise ConfigError("run.checkpoint_every must be >= 0 and run.keep_checkpoints >= 1")
    if cfg.run.num_threads < 0:
        raise ConfigError(f"run.num_threads: must be >= 0, got {cfg.run.num_threads}")
    for tracker in cfg.run.trackers:
        if tracker not in ("wandb", "tensorboard"):
            raise ConfigError(f"run.trackers: unknown tracker {tracker!r} (wandb, tensorboard)")
    _positive(cfg.data, "data", "max_prompt_length", "max_length")
    if cfg.model.attn_implementation == "flash_attention_2" and not _installed("flash_attn"):
        raise ConfigError(
            "model.attn_implementation: flash_attention_2 needs the flash-attn package "
            "(pip install flash-attn) and a CUDA GPU; use sdpa or auto otherwise"
        )
    if stage in ("sft", "rm"):
        section = getattr(cfg, stage)
        _positive(section, stage, "epochs", "batch_size", "micro_batch_size")
        _divides(
            (
                f"{stage}.micro_batch_size x {world_size} ranks",
                section.micro_batch_size * world_size,
            ),
            (f"{stage}.batch_size", section.batch_size),
        )
        _validate_optim(section.optim, f"{stage}.optim")
        if not cfg.data.train:
            raise ConfigError("data.train: required (a local data file or a hub dataset name)")
        if stage == "sft" and not cfg.model.policy:
            raise ConfigError("model.policy: required (the causal LM to fine-tune)")
        if stage == "rm" and not (cfg.model.reward or cfg.model.policy):
            raise ConfigError("model.reward: required (the model to train as reward model)")
    if stage == "ppo":
        _validate_ppo(cfg, world_size)
    _positive(cfg.lora, "lora", "r", "alpha")
    if cfg.lora.critic and not cfg.lora.enabled:
        raise ConfigError("lora.critic: needs lora.enabled=true")
    if stage == "eval":
        _positive(cfg.eval, "eval", "num_prompts", "batch_size")
    if stage in ("ppo", "eval"):
        _validate_generation(cfg)
        if not cfg.model.policy:
            raise ConfigError("model.policy: required (the SFT policy)")
        if not (cfg.reward.function or cfg.model.reward):
            raise ConfigError("model.reward: required unless reward.function is set")
        if cfg.reward.function and ":" not in cfg.reward.function:
            raise ConfigError(
                f"reward.function: expected 'module:callable', got {cfg.reward.function!r}"
            )


def _validate_optim(optim: OptimConfig, prefix: str) -> None:
    _positive(optim, prefix, "lr", "adam_eps", "max_grad_norm")
    if optim.warmup_steps < 0:
        raise ConfigError(f"{prefix}.warmup_steps: must be >= 0")


def _validate_generation(cfg: Config) -> None:
    g = cfg.generation
    _positive(g, "generation", "max_new_tokens", "temperature")
    if not 0 < g.top_p <= 1:
        raise ConfigError(f"generation.top_p: must be in (0, 1], got {g.top_p}")
    if not 0 <= g.min_new_tokens <= g.max_new_tokens:
        raise ConfigError(
            f"generation.min_new_tokens: must be in [0, max_new_tokens], got {g.min_new_tokens}"
        )
    if g.top_k < 0:
        raise ConfigError(f"generation.top_k: must be >= 0, got {g.top_k}")


def _validate_ppo(cfg: Config, world_size: int) -> None:
    p = cfg.ppo
    names = ("iterations", "rollout_batch_size", "rollout_micro_batch_size", "ppo_epochs")
    _positive(p, "ppo", *names, "minibatch_size", "micro_batch_size")
    if p.clip_eps is not None and not p.clip_eps > 0:
        raise ConfigError(f"ppo.clip_eps: must be > 0 or null (no clipping), got {p.clip_eps}")
    _divides(("world size", world_size), ("ppo.rollout_batch_size", p.rollout_batch_size))
    _divides(
        ("ppo.minibatch_size", p.minibatch_size), ("ppo.rollout_batch_size", p.rollout_batch_size)
    )
    _divides(
        (f"ppo.micro_batch_size x {world_size} ranks", p.micro_batch_size * world_size),
        ("ppo.minibatch_size", p.minibatch_size),
    )
    if not 0 <= p.gamma <= 1:
        raise ConfigError(f"ppo.gamma: must be in [0, 1], got {p.gamma}")
    if not 0 <= p.lam <= 1:
        raise ConfigError(f"ppo.lam: must be in [0, 1], got {p.lam}")
    if p.kl_coef < 0:
        raise ConfigError(f"ppo.kl_coef: must be >= 0, got {p.kl_coef}")
    if p.kl_controller == "adaptive":
        _positive(p, "ppo", "kl_target", "kl_horizon")
    if p.value_clip_eps is not None and p.value_clip_eps <= 0:
        raise ConfigError(f"ppo.value_clip_eps: must be > 0 or null, got {p.value_clip_eps}")
    _validate_optim(p.actor, "ppo.actor")
    _validate_optim(p.critic, "ppo.critic")
    if cfg.reward.clip is not None and not cfg.reward.clip > 0:
        raise ConfigError(f"reward.clip: must be > 0 or null, got {cfg.reward.clip}")
    if not cfg.data.train:
        raise ConfigError("data.train: required (a prompt file or a hub dataset name)")
