"""Environment specs: `verifiers:ENV_ID?key=value&...` names an environment of the verifiers
library (PyPI `verifiers`, its classic `Environment` API; docs/agents.md, "verifiers
environments"), as `generation.environment` (the environment plays every episode through
the rollout servers' chat endpoint) and as `data.train` / `data.eval` (the environment's
own dataset, or its evaluation dataset, as prompt rows).

ENV_ID is what `verifiers.load_environment` takes: an installed environment package or
any importable module with a `load_environment(**args)` function; `key=value` pairs are its
arguments, read as YAML (`3` a number, `true` a bool). Parsed here, torch-free and without
importing verifiers, so a malformed spec or a missing package is one line before anything
loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlhf_dist.config.loading import spec_options
from rlhf_dist.errors import ConfigError

PREFIX = "verifiers:"
FORM = "verifiers:ENV_ID?key=value&..."
INSTALL = "bash launch/setup.sh installs it (verifiers 0.3.x, classic API; docs/agents.md)"


@dataclass(frozen=True)
class EnvironmentSpec:
    env_id: str  # verifiers.load_environment's id (a module name, `-` read as `_`)
    args: tuple[tuple[str, Any], ...]  # load_environment's keyword arguments


def is_environment_spec(value: object) -> bool:
    return isinstance(value, str) and value.startswith(PREFIX)


def parse_environment_spec(value: str, key: str) -> EnvironmentSpec:
    """`value` (a `verifiers:` spec) parsed; a ConfigError naming `key` if malformed."""
    env_id, _, query = value[len(PREFIX) :].partition("?")
    module = env_id.replace("-", "_").split("/")[-1]
    if not all(part.isidentifier() for part in module.split(".")):
        raise ConfigError(
            f"{key}: {value!r} names no environment: expected {FORM}, ENV_ID an installed "
            "verifiers environment or a module with load_environment()"
        )
    return EnvironmentSpec(env_id, tuple(spec_options(query, value, key, FORM).items()))
