"""Task specs: a `data.train` / `data.eval` value that names rows a library generates
rather than a file holds (docs/grpo.md, "Verifiable tasks"), and the packages of the
`tasks` extra that those rows and the shipped task rewards need.

`reasoning_gym:TASK?key=value&key=value` names one of reasoning-gym's procedural task
families, `reasoning_gym.create_dataset(TASK, size=..., seed=..., **options)`. The spec is
parsed here, torch-free and without importing reasoning-gym (a 3 s import), so validation
reports a malformed spec, overlapping train and eval seeds or a missing package in one line
before anything loads; the task name and its options are checked against reasoning-gym
when the rows are made (`rlhf_dist.data.tasks`), still before any model loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlhf_dist.config.loading import is_int, spec_options
from rlhf_dist.errors import ConfigError

PREFIX = "reasoning_gym:"
INSTALL = "pip install 'rlhf_dist[tasks]'"
# The packages of the tasks extra: import name -> the name pip installs.
PACKAGES = {"reasoning_gym": "reasoning-gym", "math_verify": "math-verify"}
# The shipped task rewards (rlhf_dist/rewards/tasks.py) -> the package each imports.
REWARD_MODULE = "rlhf_dist.rewards.tasks"
REWARD_PACKAGES = {"reasoning_gym": "reasoning_gym", "math_verify": "math_verify"}
# Spec keys that are ours, not the task's configuration (no reasoning-gym config has a
# field of that name). size and seed are fields of every task's configuration.
SYSTEM_PROMPT = "system_prompt"
DEFAULTS = {"size": 500, "seed": 0, SYSTEM_PROMPT: "default"}
FORM = "reasoning_gym:TASK?size=N&seed=S&key=value..."


@dataclass(frozen=True)
class TaskSpec:
    """A parsed `reasoning_gym:` spec. Row i is drawn by reasoning-gym from the random
    seed `seed + i` (every task seeds its i-th entry so), so the rows are `seeds`."""

    task: str  # a reasoning-gym task name, e.g. basic_arithmetic
    size: int  # rows
    seed: int
    system_prompt: str  # a name of reasoning_gym.utils.SYSTEM_PROMPTS, or none
    options: tuple[tuple[str, Any], ...]  # the task configuration's other fields

    @property
    def seeds(self) -> range:
        return range(self.seed, self.seed + self.size)

    def config(self) -> dict[str, Any]:
        """The keyword arguments of reasoning_gym.create_dataset besides the name."""
        return {**dict(self.options), "size": self.size, "seed": self.seed}


def is_task_spec(value: object) -> bool:
    return isinstance(value, str) and value.startswith(PREFIX)


def parse_task_spec(value: str, key: str) -> TaskSpec:
    """`value` (a `reasoning_gym:` spec) parsed; a ConfigError naming `key` if malformed.
    Values are read as YAML, as command-line overrides are: `3` is a number, `true` a
    bool, `[+, -]` a list, anything else text."""
    name, _, query = value[len(PREFIX) :].partition("?")
    if not name.isidentifier():
        raise ConfigError(
            f"{key}: {value!r} names no task: expected {FORM}, TASK a reasoning-gym task "
            "name such as basic_arithmetic"
        )
    given = spec_options(query, value, key, FORM)
    size, seed, prompt = (given.pop(k, default) for k, default in DEFAULTS.items())
    if not is_int(size) or size < 1:
        raise ConfigError(f"{key}: size={size!r} in {value!r} must be an integer >= 1")
    if not is_int(seed) or seed < 0:
        raise ConfigError(f"{key}: seed={seed!r} in {value!r} must be an integer >= 0")
    if not isinstance(prompt, str):
        raise ConfigError(f"{key}: {SYSTEM_PROMPT}={prompt!r} in {value!r} must be a name")
    return TaskSpec(name, size, seed, prompt, tuple(given.items()))


def held_out_overlap(train: TaskSpec, held_out: TaskSpec) -> str | None:
    """Why `held_out` (data.eval) would repeat rows of `train` (data.train), or None: the
    same task drawn from overlapping seeds gives the same rows."""
    if train.task != held_out.task:
        return None
    a, b = train.seeds, held_out.seeds
    if b.start >= a.stop or a.start >= b.stop:
        return None
    return (
        f"its {held_out.task} rows come from seeds {b.start}..{b.stop - 1}, which "
        f"data.train's seeds {a.start}..{a.stop - 1} overlap (row i is drawn from seed + i): "
        f"set seed={a.stop} or more"
    )
