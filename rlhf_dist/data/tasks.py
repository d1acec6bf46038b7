"""Rows of a reasoning-gym task: `data.train=reasoning_gym:TASK?size=N&seed=S&...`
(the spec: config/tasks.py; docs/grpo.md, "Verifiable tasks").

reasoning-gym (106 procedural task families) draws entry i of a task from the random seed
`seed + i`, as {question, answer, metadata}. Each becomes one prompt row:

    {"prompt": [{"role": "system", "content": <reasoning-gym's system prompt>},
                {"role": "user", "content": question}],
     "question": question, "answer": answer, "metadata": metadata, "task": <the spec>}

A chat prompt, so the policy's chat template applies; the system prompt is the one
reasoning-gym's own evaluations use (`system_prompt=default`: think, then the answer in
<answer></answer> tags), `system_prompt=none` leaves it out. The other columns are what the
task's scorer reads (rlhf_dist/rewards/tasks.py rebuilds the task from `task`, since some
scorers read the task's configuration). Held-out rows (data.eval) come from other seeds
(validation refuses overlapping ones), and any whose question data.train also holds is left
out: different seeds can draw the same small question ("Calculate 2 - -1.").
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any

from rlhf_dist.config.tasks import INSTALL, SYSTEM_PROMPT, TaskSpec, parse_task_spec
from rlhf_dist.errors import ConfigError

# spec -> reasoning-gym's dataset object (its scorer reads it) and its entries, made once
# per process: the held-out rows compare their questions with data.train's.
_DATASETS: dict[str, Any] = {}
_ENTRIES: dict[str, list[dict]] = {}


def library(key: str) -> ModuleType:
    """The reasoning_gym module, or a ConfigError naming `key` and the extra."""
    try:
        import reasoning_gym
    except ImportError:
        raise ConfigError(
            f"{key}: reasoning_gym tasks need the reasoning-gym package, which is not "
            f"installed: {INSTALL}"
        ) from None
    return reasoning_gym


def task_dataset(source: str, key: str) -> Any:
    """reasoning-gym's dataset of the spec `source` (entries by index, `score_answer`),
    made once per process; a ConfigError naming `key` for an unknown task or option, or a
    configuration the task refuses."""
    if source not in _DATASETS:
        _DATASETS[source] = _make_dataset(parse_task_spec(source, key), key)
    return _DATASETS[source]


def _make_dataset(spec: TaskSpec, key: str) -> Any:
    """reasoning-gym's dataset of `spec`, its task and options checked first so that a
    mistake is one ConfigError line naming `key` (the task list, the task's options)."""
    rg = library(key)
    from reasoning_gym.factory import DATASETS

    if spec.task not in DATASETS or spec.task == "composite":
        raise ConfigError(
            f"{key}: reasoning-gym has no task {spec.task!r} (e.g. basic_arithmetic, "
            "chain_sum, leg_counting; the list: reasoning_gym.factory.DATASETS)"
        )
    fields = {f.name for f in dataclasses.fields(DATASETS[spec.task][1])}
    unknown = [name for name, _ in spec.options if name not in fields]
    if unknown:
        options = ", ".join(sorted(fields - {"size", "seed"}))
        raise ConfigError(
            f"{key}: {spec.task} has no option {unknown[0]!r} (its options: {options}; "
            f"and size, seed, {SYSTEM_PROMPT})"
        )
    try:
        return rg.create_dataset(spec.task, **spec.config())
    except (AssertionError, TypeError, ValueError) as e:  # the task's own config checks
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"{key}: {spec.task} refuses its options: {first}") from None


def task_entries(source: str, key: str) -> list[dict]:
    """The spec's entries {question, answer, metadata}, in seed order (cached)."""
    if source not in _ENTRIES:
        dataset = task_dataset(source, key)
        _ENTRIES[source] = [dataset[i] for i in range(len(dataset))]
    return _ENTRIES[source]


def system_prompt(name: str, key: str) -> str | None:
    """reasoning-gym's system prompt called `name` (None for `none`)."""
    if name == "none":
        return None
    library(key)
    from reasoning_gym.utils import SYSTEM_PROMPTS

    if name not in SYSTEM_PROMPTS:
        raise ConfigError(
            f"{key}: {SYSTEM_PROMPT}={name!r}: expected none or one of reasoning-gym's "
            f"{', '.join(SYSTEM_PROMPTS)}"
        )
    return SYSTEM_PROMPTS[name]


def task_rows(source: str, key: str, held_out_from: str = "") -> list[dict]:
    """The prompt rows of the spec `source` (module docstring). held_out_from: data.train's
    spec when these are data.eval's rows; those whose question it holds are left out."""
    spec = parse_task_spec(source, key)
    system = system_prompt(spec.system_prompt, key)
    seen = (
        {e["question"] for e in task_entries(held_out_from, "data.train")}
        if held_out_from
        else set()
    )
    return [
        task_row(entry, system, source)
        for entry in task_entries(source, key)
        if entry["question"] not in seen
    ]


def task_row(entry: dict, system: str | None, source: str) -> dict:
    """One reasoning-gym entry as a prompt row with its scorer's columns."""
    user = {"role": "user", "content": entry["question"]}
    prompt = [{"role": "system", "content": system}, user] if system else [user]
    return {
        "prompt": prompt,
        "question": entry["question"],
        "answer": entry["answer"],
        "metadata": entry["metadata"],
        "task": source,
    }
