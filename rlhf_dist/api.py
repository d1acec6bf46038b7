"""The Python API: one function per stage, for notebooks and scripts.

What a notebook user has is a `datasets.Dataset` (or a list of dicts), a reward callable
defined in the same cell, and a model name. Each function takes those objects and the same
config keys as the command line, runs the stage in this process, writes the same run
directory as `rlhf-dist <stage>` and returns its summary (summary.json's contents):

    import rlhf_dist
    summary = rlhf_dist.ppo(
        {"model": {"policy": "HuggingFaceTB/SmolLM2-135M-Instruct"},
         "ppo.estimator": "grpo", "run.output_dir": "runs/grpo"},
        dataset=prompts,                      # rows with a "prompt" column
        reward_fn=lambda prompts, responses: [len(r) / 100 for r in responses],
    )

`config` is a `Config`, a YAML path, or a dict of sections and/or dotted keys
("ppo.kl_coef": 0.1); `overrides` are `section.key=value` strings applied last, as on the
command line. The objects are registered for the run under `python:<key>` specs
(rlhf_dist.data.inputs), so config.yaml records where each value came from. The command line
is a thin layer over `run` (cli.py). Under `accelerate launch`, every rank runs the script
and calls the same functions, and the script ends with `sys.exit(end_process())`.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlhf_dist.config import (
    Config,
    apply_override,
    config_from_dict,
    deep_merge,
    to_dict,
    validate,
)
from rlhf_dist.config.loading import read_tree
from rlhf_dist.config.presets import preset_tree, stage_and_preset

if TYPE_CHECKING:  # torch loads when a stage runs (rlhf-dist --help stays instant)
    from rlhf_dist.distributed import Runtime

# stage -> "module:function" of its runner (cfg, runtime) -> summary
RUNNERS = {
    "sft": "rlhf_dist.trainers.sft:train_sft",
    "rm": "rlhf_dist.trainers.reward:train_reward_model",
    "ppo": "rlhf_dist.trainers.ppo:train_ppo",
    "dpo": "rlhf_dist.trainers.dpo:train_dpo",
    "kto": "rlhf_dist.trainers.kto:train_kto",
    "eval": "rlhf_dist.evaluate:run_eval",
    "iterate": "rlhf_dist.iterative:run_iterate",
}


def config_of(
    config: Config | str | Path | dict[str, Any] | None = None,
    overrides: Sequence[str] = (),
    preset: str | None = None,
) -> Config:
    """A frozen Config from a Config, a YAML path, a dict (sections and/or dotted keys) or
    None (the defaults), over a preset (config/presets.py; every key the config sets wins,
    for a Config object every key that differs from its default), with `section.key=value`
    overrides applied last."""
    if isinstance(config, Config):
        tree = explicit_keys(to_dict(config), to_dict(Config()))
    elif isinstance(config, (str, Path)):
        tree = read_tree(config)
    elif config is None:
        tree = {}
    elif isinstance(config, dict):
        tree = {}
        for name, value in config.items():
            for part in reversed(str(name).split(".")):
                value = {part: value}
            tree = deep_merge(tree, value, str(name))
    else:
        from rlhf_dist.errors import ConfigError

        raise ConfigError(f"config: expected a Config, a YAML path or a dict, not {config!r}")
    tree = deep_merge(preset_tree(preset), tree, "config")
    for override in overrides:
        tree = apply_override(tree, override)
    return config_from_dict(tree)


def explicit_keys(tree: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """The entries of a config tree that differ from the defaults' (nested)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and isinstance(defaults.get(key), dict):
            inner = explicit_keys(value, defaults[key])
            if inner:
                out[key] = inner
        elif value != defaults.get(key):
            out[key] = value
    return out


def _with_keys(cfg: Config, values: dict[str, str | tuple[str, ...]]) -> Config:
    """`cfg` with dotted keys set (the `python:` specs of the objects given)."""
    sections: dict[str, dict[str, str | tuple[str, ...]]] = {}
    for dotted, value in values.items():
        section, name = dotted.split(".")
        sections.setdefault(section, {})[name] = value
    return dataclasses.replace(
        cfg, **{s: dataclasses.replace(getattr(cfg, s), **kv) for s, kv in sections.items()}
    )


_RUNTIMES: dict[tuple, Runtime] = {}


def _runtime(cfg: Config) -> Runtime:
    """The process's Runtime for a run's settings (Accelerate's state is process-wide:
    stages in one process share it), seeded for this run."""
    from rlhf_dist.distributed import Runtime
    from rlhf_dist.distributed.backend import seed_everything
    from rlhf_dist.engine.cpu import apply_host_memory_setting
    from rlhf_dist.models import quiet_transformers, train_dtype

    quiet_transformers()
    r, d = cfg.run, cfg.distributed
    settings = (
        cfg.perf.num_threads,
        d.timeout_s,
        train_dtype(cfg.model),
        tuple(r.trackers),
        r.output_dir,
        d.sequence_parallel_size,
    )
    if settings not in _RUNTIMES:
        if not _RUNTIMES:
            atexit.register(close)
        _RUNTIMES[settings] = Runtime(None, *settings)
        apply_host_memory_setting(cfg.perf, _RUNTIMES[settings].device)
    seed_everything(r.seed)
    return _RUNTIMES[settings]


def close(failed: bool = False) -> None:
    """Leave the process group (once per process, after the last stage). After a failure
    (`failed`, or an uncaught exception ending the script) without the closing barrier:
    a rank that failed alone would wait there while its peers wait in a collective it
    never joins, both until distributed.timeout_s; without it the process exits at once
    and its launcher stops the other ranks."""
    failed = failed or getattr(sys, "last_value", None) is not None
    while _RUNTIMES:
        runtime = _RUNTIMES.popitem()[1]
        if not failed:
            runtime.close()


def end_process(code: int = 0) -> int:
    """The end of a script that ran stages on several ranks (or with a rollout server):
    `sys.exit(rlhf_dist.api.end_process())`. Where this process made a gloo group it runs
    the atexit handlers (close() among them), flushes the output and leaves at once with
    `code`: the interpreter's own teardown can abort or hang a rank whose work is done
    (distributed/process_exit.py). Otherwise `code` comes back."""
    exits = sys.modules.get("rlhf_dist.distributed.process_exit")  # not imported: no group
    return code if exits is None else exits.end_process(code)


def run(stage: str, cfg: Config, objects: dict[str, object] | None = None) -> dict[str, Any]:
    """Run `stage` ("sft", "rm", "ppo", "dpo", "kto", "eval", "iterate") with `cfg`; `objects` maps
    config keys (e.g. "data.train", "reward.function") to Python objects standing for them.
    Returns the stage's summary."""
    from rlhf_dist.data import inputs

    given = {k: v for k, v in (objects or {}).items() if v is not None}
    # A function of this package (a shipped task reward, the demo's) goes in by its
    # `module:name`, as on the command line: config.yaml records it, and validation checks
    # the package it needs before anything loads.
    named = {k: spec for k, v in given.items() if (spec := inputs.package_spec(v))}
    given = {k: v for k, v in given.items() if k not in named}
    with inputs.registered(given) as specs:
        cfg = _with_keys(cfg, {**specs, **named})
        # Checked before anything heavy: world size comes from the launcher's environment.
        validate(cfg, stage, int(os.environ.get("WORLD_SIZE", "1")))
        return run_validated(stage, cfg)


def run_validated(stage: str, cfg: Config) -> dict[str, Any]:
    """`run` of a `cfg` already validated for `stage` at this world size: the command
    line validates before torch loads (cli.py), so the config is checked once per
    command. Only a config the memory plan derives (run.auto_fit) is validated again."""
    module_name, _, fn_name = RUNNERS[stage].partition(":")
    runner = getattr(importlib.import_module(module_name), fn_name)
    runtime = _runtime(cfg)
    cfg = _planned(cfg, stage, runtime)
    summary: dict[str, Any] = runner(cfg, runtime)
    return summary


def _planned(cfg: Config, stage: str, runtime: Runtime) -> Config:
    """The memory plan before any model loads (rlhf_dist/planning/start.py): its line
    printed, a GPU run that cannot fit refused, and with run.auto_fit the derived config
    (validated like the given one) that the run then uses."""
    from rlhf_dist.planning.start import plan_at_start, run_hardware

    planned, lines = plan_at_start(cfg, stage, run_hardware(runtime))
    for line in lines:
        runtime.print(f"{stage}: {line}")
    if planned is not cfg:
        validate(planned, stage, runtime.world_size)
    return planned


# What the stage functions take: a Config, a YAML path or a dict of keys; a dataset
# (datasets.Dataset or a list of dicts, typed loosely: datasets loads with the stage).
ConfigLike = Config | str | Path | dict[str, Any] | None
Overrides = Sequence[str]
# reward_fn of the API: one function, or TRL's list of them (reward.functions), where a
# string names a reward model (a path or hub id)
RewardFns = Callable[..., Any] | Sequence[Callable[..., Any] | str] | None


def sft(
    config: ConfigLike = None,
    *,
    dataset: object = None,
    eval_dataset: object = None,
    overrides: Overrides = (),
) -> dict[str, Any]:
    """Supervised fine-tuning; `dataset` rows as in docs/data.md (messages, prompt +
    completion, prompt + response)."""
    objects = {"data.train": dataset, "data.eval": eval_dataset}
    return run("sft", config_of(config, overrides), objects)


def reward_model(
    config: ConfigLike = None,
    *,
    dataset: object = None,
    eval_dataset: object = None,
    overrides: Overrides = (),
) -> dict[str, Any]:
    """A Bradley-Terry reward model on preference pairs (chosen / rejected)."""
    objects = {"data.train": dataset, "data.eval": eval_dataset}
    return run("rm", config_of(config, overrides), objects)


def ppo(
    config: ConfigLike = None,
    *,
    dataset: object = None,
    reward_fn: RewardFns = None,
    overrides: Overrides = (),
    preset: str | None = None,
    reward_weights: Sequence[float] | None = None,
) -> dict[str, Any]:
    """PPO or a critic-free estimator (ppo.estimator, or a `preset`: grpo, dr_grpo, dapo,
    gspo, rloo, reinforce_pp) on `dataset`'s prompts, scored by `reward_fn` (TRL's
    `(prompts, completions, **columns)` or `(prompts, responses)`, docs/rewards.md) or by
    model.reward. A list of functions is TRL's `reward_funcs`: reward.functions, weighted
    by `reward_weights` (reward.weights; None: 1 each), each logged under its name."""
    cfg = config_of(config, overrides, preset)
    if reward_weights is not None:
        weights = tuple(float(w) for w in reward_weights)
        cfg = dataclasses.replace(cfg, reward=dataclasses.replace(cfg.reward, weights=weights))
    return run("ppo", cfg, {"data.train": dataset} | reward_objects(reward_fn))


def reward_objects(reward_fn: RewardFns) -> dict[str, object]:
    """The config key a `reward_fn` of the API stands for: reward.function for one
    callable, reward.functions for a list or tuple of them (TRL's reward_funcs)."""
    if isinstance(reward_fn, list | tuple):
        return {"reward.functions": list(reward_fn)}
    return {"reward.function": reward_fn}


def grpo(
    config: ConfigLike = None,
    *,
    dataset: object = None,
    reward_fn: RewardFns = None,
    overrides: Overrides = (),
    reward_weights: Sequence[float] | None = None,
) -> dict[str, Any]:
    """GRPO: `ppo` with the grpo preset (docs/grpo.md), every key of `config` over it;
    `reward_fn` one function or a list of them, weighted by `reward_weights` (TRL's)."""
    _, preset = stage_and_preset("grpo")
    return ppo(
        config,
        dataset=dataset,
        reward_fn=reward_fn,
        overrides=overrides,
        preset=preset,
        reward_weights=reward_weights,
    )


def online_dpo(
    config: ConfigLike = None,
    *,
    dataset: object = None,
    reward_fn: RewardFns = None,
    overrides: Overrides = (),
) -> dict[str, Any]:
    """Online DPO (docs/online_dpo.md): `ppo` with the online_dpo preset (TRL's
    OnlineDPOTrainer defaults), every key of `config` over it. The labeller is `reward_fn`,
    model.reward or reward.judge; beta is ppo.kl_coef."""
    return ppo(
        config, dataset=dataset, reward_fn=reward_fn, overrides=overrides, preset="online_dpo"
    )


def dpo(
    config: ConfigLike = None,
    *,
    dataset: object = None,
    eval_dataset: object = None,
    overrides: Overrides = (),
) -> dict[str, Any]:
    """DPO / conservative DPO / IPO on preference pairs."""
    objects = {"data.train": dataset, "data.eval": eval_dataset}
    return run("dpo", config_of(config, overrides), objects)


def kto(
    config: ConfigLike = None,
    *,
    dataset: object = None,
    eval_dataset: object = None,
    overrides: Overrides = (),
) -> dict[str, Any]:
    """KTO on labelled completions (or preference pairs)."""
    objects = {"data.train": dataset, "data.eval": eval_dataset}
    return run("kto", config_of(config, overrides), objects)


def eval(
    config: ConfigLike = None,
    *,
    dataset: object = None,
    reward_fn: RewardFns = None,
    gold_fn: Callable[..., Any] | None = None,
    overrides: Overrides = (),
) -> dict[str, Any]:
    # Named like the `rlhf-dist eval` stage: `rlhf_dist.evaluate` is the module that runs it.
    """Score model.policy on held-out prompts (`dataset`, else data.eval / data.train) with
    `reward_fn` (one function, or TRL's list of them: reward.functions) or model.reward;
    `gold_fn(prompts, responses, finished)` is an optional oracle (eval.gold_function)."""
    objects = {"data.eval": dataset, "eval.gold_function": gold_fn} | reward_objects(reward_fn)
    return run("eval", config_of(config, overrides), objects)


def iterate(
    config: ConfigLike = None,
    *,
    labeller: Callable[..., Any] | None = None,
    overrides: Overrides = (),
) -> dict[str, Any]:
    """Iterative RLHF (docs/iterate.md): iterate.rounds rounds of sampling answer pairs from
    the current policy, labelling them with `labeller(prompt, a, b) -> bool or P(a
    preferred)` (else iterate.labeller), a reward model on all pairs so far and PPO."""
    return run("iterate", config_of(config, overrides), {"iterate.labeller": labeller})
