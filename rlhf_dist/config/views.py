"""Views of the config: the keys a stage reads, with a preset's estimator deciding which
of the PPO loop's keys are among them. Derived from each key's own declaration
(`key(..., needs="critic")`, `key(..., estimators=(...))`, config/keys.py) read with the
estimator traits of algo/catalog.py: a GRPO user is shown no GAE, critic or value key,
a PPO (gae) user every one. `rlhf-dist config --yaml NAME` (config/starter.py) and
`rlhf-dist config NAME` (`describe_view`) print these views."""

from __future__ import annotations

import dataclasses

from rlhf_dist.config.loading import _walk, describe, load_config
from rlhf_dist.config.presets import PRESETS, stage_and_preset
from rlhf_dist.config.schema import Config
from rlhf_dist.names import ESTIMATORS

COMMON = ("run", "model", "data", "perf", "lora", "distributed")
RL = ("generation", "reward", "ppo", "alerts", "debug")
# The sections each stage reads (the rest of a config is ignored by it).
STAGE_SECTIONS: dict[str, tuple[str, ...]] = {
    "sft": (*COMMON, "sft"),
    "rm": (*COMMON, "rm"),
    "dpo": (*COMMON, "dpo"),
    "kto": (*COMMON, "kto"),
    "ppo": (*COMMON, *RL),
    "eval": (*COMMON, "generation", "reward", "eval"),
    "iterate": (*COMMON, *RL, "rm", "eval", "iterate"),
}
# The stages that run the PPO loop, whose ppo.estimator decides what they read.
PPO_LOOP = ("ppo", "iterate")


def estimator_reads(f: dataclasses.Field, estimator: str) -> bool:
    """Whether ppo.estimator=`estimator` reads the key declared by `f`: one declared with
    `needs=TRAIT` only when the estimator has that trait (EstimatorTraits.needs_TRAIT),
    one with `estimators=(...)` only when it is among them; any other key always."""
    needs, only = f.metadata.get("needs"), f.metadata.get("estimators")
    if needs and not getattr(ESTIMATORS[estimator], f"needs_{needs}"):
        return False
    return not only or estimator in only


def reads(f: dataclasses.Field, stage: str, estimator: str) -> bool:
    """Whether `stage` reads the key of `f` when ppo.estimator is `estimator`: a key
    declared for some estimators only is read by the PPO loop alone (ppo, iterate)."""
    if "needs" not in f.metadata and "estimators" not in f.metadata:
        return True
    return stage in PPO_LOOP and estimator_reads(f, estimator)


def unread_keys(cfg: Config, stage: str) -> set[str]:
    """The dotted keys and subsections (ppo.critic_optim) of `stage`'s sections that it
    does not read with `cfg`'s estimator; a subsection's keys go with it."""
    sections = STAGE_SECTIONS[stage]
    return {
        name
        for name, f, _, _ in _walk(cfg)
        if name.split(".")[0] in sections and not reads(f, stage, cfg.ppo.estimator)
    }


def is_read(name: str, unread: set[str]) -> bool:
    """Whether the dotted key `name` is outside `unread` and every subsection in it."""
    parts = name.split(".")
    return not any(".".join(parts[:i]) in unread for i in range(1, len(parts) + 1))


def view_config(name: str) -> tuple[str, Config]:
    """(stage, the defaults it runs with) of a stage or preset `name` (grpo: ppo with the
    grpo preset's keys)."""
    stage, preset = stage_and_preset(name)
    return stage, load_config(None, [], preset)


def describe_view(name: str) -> str:
    """`rlhf-dist config PRESET`: every key the preset's stage reads, with the preset's
    values as defaults (no key its estimator does not read)."""
    stage, cfg = view_config(name)
    unread = unread_keys(cfg, stage)
    sections = STAGE_SECTIONS[stage]
    head = (
        f"Keys of rlhf-dist {stage} --preset {name} (ppo.estimator={cfg.ppo.estimator}), with "
        f"the preset's values; left out, as it does not read them: {', '.join(sorted(unread))}"
    )
    body = describe("", cfg, lambda key: key.split(".")[0] in sections and is_read(key, unread))
    return head + "\n\n" + body


def is_view(name: str) -> bool:
    """Whether `rlhf-dist config NAME` names a preset's view rather than a section or key."""
    return name in PRESETS
