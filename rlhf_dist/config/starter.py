"""`rlhf-dist config --yaml STAGE`: a starter config file a user edits and runs, every key
the stage reads with its value (a preset's where STAGE names one) and its help as a
comment; a key the preset's estimator does not read is left out (config/views.py). The
file reads back to the same Config (tested)."""

from __future__ import annotations

import dataclasses
import json
import textwrap
from typing import Any

from rlhf_dist.config.loading import _walk, load_config
from rlhf_dist.config.presets import stage_and_preset
from rlhf_dist.config.schema import Config
from rlhf_dist.config.views import STAGE_SECTIONS, is_read, unread_keys

# What a starter file names where the stage needs a value (edit these first).
EXAMPLES: dict[str, dict[str, Any]] = {
    "sft": {"data.train": "sft.jsonl"},
    "rm": {"data.train": "preferences.jsonl"},
    "dpo": {"data.train": "preferences.jsonl"},
    "kto": {"data.train": "preferences.jsonl"},
    "ppo": {"data.train": "prompts.jsonl", "reward.function": "rewards:accuracy"},
    "eval": {"data.train": "prompts.jsonl", "reward.function": "rewards:accuracy"},
    "iterate": {"data.train": "prompts.jsonl", "data.eval": "heldout_prompts.jsonl"},
}
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def starter_yaml(name: str) -> str:
    """The starter file of stage or preset `name` (grpo, dapo, ... run as `rlhf-dist ppo
    --preset NAME`, or `rlhf-dist grpo`): the keys the stage reads with the preset's
    estimator (config/views.py: a critic-free preset's file has no critic, GAE or value key)."""
    stage, preset = stage_and_preset(name)
    examples = {"model.policy": MODEL, "run.output_dir": f"runs/{name}", **EXAMPLES[stage]}
    overrides = [
        f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in examples.items()
    ]
    cfg = load_config(None, overrides, preset)
    command = f"rlhf-dist {name} --config {name}.yaml" if name in ("grpo", *STAGE_SECTIONS) else (
        f"rlhf-dist ppo --preset {name} --config {name}.yaml")  # fmt: skip
    lines = [
        f"# Starter config of `{command}` (written by `rlhf-dist config --yaml {name}`).",
        "# Every key this stage reads, with its value and meaning; set model.policy,",
        "# data.train and the reward to yours, delete what you keep at its default.",
    ]
    unread = unread_keys(cfg, stage)
    for section in STAGE_SECTIONS[stage]:
        lines += ["", *_section_lines(getattr(cfg, section), section, 0, unread)]
    return "\n".join(lines) + "\n"


def _section_lines(section: Any, name: str, depth: int, unread: set[str]) -> list[str]:
    """`name:` (a dotted path) then each key of `section` with its help as comments,
    nested sections indented; the keys in `unread` left out."""
    pad = "  " * depth
    help_text = {f.name: f.metadata.get("help", "") for f in dataclasses.fields(section)}
    top = {f.name: f.metadata.get("help", "") for f in dataclasses.fields(Config)}
    short = name.rsplit(".", 1)[-1]
    out = [f"{pad}{short}:" + (f"  # {top[name]}" if depth == 0 and top.get(name) else "")]
    for key, _, _, value in _walk(section):
        if "." in key or not is_read(f"{name}.{key}", unread):
            continue  # nested keys are written with their subsection
        wrapped = textwrap.wrap(help_text[key], 96 - len(pad))
        out += [f"{pad}  # {line}" for line in wrapped]
        if dataclasses.is_dataclass(value):
            out += _section_lines(value, f"{name}.{key}", depth + 1, unread)
            continue
        out.append(f"{pad}  {key}: {_yaml_value(value)}")
    return out


def _yaml_value(value: Any) -> str:
    """A value as YAML reads it back (JSON is YAML for these types)."""
    if isinstance(value, tuple):
        value = list(value)
    return json.dumps(value)
