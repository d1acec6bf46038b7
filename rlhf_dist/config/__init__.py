"""Run configuration: frozen dataclasses, one per section, from YAML plus `a.b=c` overrides.

Every mistake a user can make in a config (unknown key, wrong type, a value outside its
choices or range, an impossible combination) raises `ConfigError` with a one-line message naming
the key, before any model is loaded. Config objects are never written to at run time;
numbers derived from them (per-rank batch sizes, accumulation steps) live in
`rlhf_dist.data.batching`.

Each key is declared once, with `key(default, help, choices=..., min=/max=/gt=/lt=)`: its
meaning and its range live there and nowhere else (`validate` checks them, then only the
rules between keys), `rlhf-dist config [SECTION]` prints it (`describe`), and a unit test fails
for a key without help. A new key is one such line in its section's dataclass.

Modules: `keys` (declaring a key), one per group of sections (`run`: run, perf,
distributed, debug, alerts; `model`: model, data, lora; `stages`: the keys every
step-loop stage shares, then sft, rm, dpo, kto; `rl`: generation, reward, ppo, eval,
iterate; `serve`: the rollout server), `schema` (the root `Config`), `loading` (YAML, overrides, renamed keys, help
text), `validation` (the rules between keys), `sizes` (the auto sizes and which models a
run loads: the trainer's rules, which the planner reads too), `presets` (and the one
grpo -> ppo mapping, `stage_and_preset`) and `views` (the keys a stage reads: a key that
only some PPO estimators read says so in its declaration, `key(..., needs="critic")` or
`key(..., estimators=(...))`, and `rlhf-dist config [--yaml] PRESET` leaves it out where the
preset's estimator does not read it). Everything public is importable from here.
"""

from __future__ import annotations

from rlhf_dist.config.keys import in_range, key, range_text
from rlhf_dist.config.loading import (
    RENAMED_KEYS,
    apply_override,
    check_keys,
    config_from_dict,
    deep_merge,
    describe,
    load_config,
    save_config,
    to_dict,
)
from rlhf_dist.config.model import DataConfig, LoRAConfig, ModelConfig
from rlhf_dist.config.rl import (
    EvalConfig,
    GenerationConfig,
    IterateConfig,
    PPOConfig,
    RewardConfig,
)
from rlhf_dist.config.run import (
    AlertsConfig,
    DebugConfig,
    DistributedConfig,
    PerfConfig,
    RunConfig,
)
from rlhf_dist.config.schema import Config
from rlhf_dist.config.serve import ServeConfig
from rlhf_dist.config.stages import (
    REFERENCE_LOGPROBS,
    DPOConfig,
    KTOConfig,
    OptimConfig,
    RMConfig,
    SFTConfig,
    StageConfig,
)
from rlhf_dist.config.starter import STAGE_SECTIONS, starter_yaml
from rlhf_dist.config.validation import bitsandbytes_problem, validate
from rlhf_dist.errors import ConfigError, RewardFunctionError, UserError

__all__ = [
    "RENAMED_KEYS",
    "REFERENCE_LOGPROBS",
    "AlertsConfig",
    "Config",
    "ConfigError",
    "DPOConfig",
    "DataConfig",
    "DebugConfig",
    "DistributedConfig",
    "EvalConfig",
    "GenerationConfig",
    "IterateConfig",
    "KTOConfig",
    "LoRAConfig",
    "ModelConfig",
    "OptimConfig",
    "PPOConfig",
    "PerfConfig",
    "RMConfig",
    "RewardConfig",
    "RewardFunctionError",
    "RunConfig",
    "SFTConfig",
    "ServeConfig",
    "StageConfig",
    "UserError",
    "apply_override",
    "bitsandbytes_problem",
    "check_keys",
    "config_from_dict",
    "deep_merge",
    "describe",
    "in_range",
    "key",
    "load_config",
    "range_text",
    "save_config",
    "STAGE_SECTIONS",
    "starter_yaml",
    "to_dict",
    "validate",
]
