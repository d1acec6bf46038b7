"""Environments of the verifiers library (`verifiers:ENV_ID?...`, config/environments.py):
loaded once per process, and their datasets as prompt rows (docs/agents.md, "verifiers
environments").

`data.train: verifiers:ENV_ID` reads the environment's dataset (`env.get_dataset()`),
`data.eval` its evaluation dataset (never the training rows in its place). verifiers has already
formatted each row: `prompt` is a message list (its system prompt included), with
`answer`, `info`, `task` and `example_id` beside it, the columns its rubric reads; the
rows keep all of them, so the episode (rollout/environments.py) hands them back. Message
fields the dataset's table filled with None (Arrow gives every message every key) are
dropped.
"""

from __future__ import annotations

from typing import Any

from rlhf_dist.config.environments import INSTALL, parse_environment_spec
from rlhf_dist.errors import ConfigError

_ENVIRONMENTS: dict[str, Any] = {}  # spec -> the loaded environment


def environment(spec: str, key: str) -> Any:
    """The verifiers environment `spec` names, loaded once per process; a ConfigError
    naming `key` when verifiers is missing or cannot load it."""
    if spec not in _ENVIRONMENTS:
        parsed = parse_environment_spec(spec, key)
        try:
            import verifiers
        except ImportError:
            raise ConfigError(f"{key}: {spec!r} needs the verifiers package: {INSTALL}") from None
        try:
            _ENVIRONMENTS[spec] = verifiers.load_environment(parsed.env_id, **dict(parsed.args))
        except Exception as e:  # the environment's own loading, whatever it raises
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ConfigError(
                f"{key}: verifiers could not load {parsed.env_id!r}: {first}"
            ) from None
    return _ENVIRONMENTS[spec]


def environment_rows(spec: str, key: str, which: str) -> list[dict]:
    """The prompt rows of the environment's dataset (`which` "train") or evaluation
    dataset ("eval"); a ConfigError naming `key` when it has none."""
    env = environment(spec, key)
    # build_*: not get_eval_dataset, which falls back to the training rows
    dataset = env.build_eval_dataset() if which == "eval" else env.build_dataset()
    if dataset is None:
        raise ConfigError(f"{key}: {spec!r} has no {'evaluation ' * (which == 'eval')}dataset")
    return [_row(dict(row)) for row in dataset]


def _row(row: dict) -> dict:
    """`row` with None-valued keys dropped from its prompt's messages: `datasets` gives
    every message every key any message has (tool_calls: None), which a chat template
    would read as present."""
    prompt = row.get("prompt")
    if isinstance(prompt, list):
        row["prompt"] = [{k: v for k, v in m.items() if v is not None} for m in prompt]
    return row
