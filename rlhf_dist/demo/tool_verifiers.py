"""The tool-use task (demo/tool_task.py) as an environment of the verifiers library:
`verifiers:rlhf_dist.demo.tool_verifiers` (docs/agents.md, "verifiers environments").

What a verifiers user writes, built offline: a `vf.ToolEnv` with the task's `lookup`
tool (a plain Python function; verifiers turns its signature and docstring into the
OpenAI tool schema and runs the calls the policy makes), the RL keys' questions as its
dataset and the held-out keys' as its evaluation dataset (write_tool_task's split at the
same seed), and a `vf.Rubric` that pays 1 for the exact answer. verifiers reads the
policy's tool calls from OpenAI `tool_calls`, which the rollout server parses from the
`<tool_call>` blocks the policy writes (serving/openai_api.py).

`rlhf-dist demo --task tool_use --algorithm grpo --through-endpoint verifiers` trains on it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rlhf_dist.demo.tool_task import QUESTION, TABLE, lookup, split_keys

if TYPE_CHECKING:
    import verifiers as vf
    from datasets import Dataset


def exact_answer(completion: Sequence[Any], answer: str) -> float:
    """1.0 when the last assistant turn is exactly "the code is ANSWER"."""
    said = [m for m in completion if _field(m, "role") == "assistant"]
    text = (_field(said[-1], "content") or "") if said else ""
    return float(str(text).split() == f"the code is {answer}".split())


def load_environment(seed: int = 0, train_keys: int = 96, max_turns: int = 3) -> vf.ToolEnv:
    """The task as a vf.ToolEnv (verifiers.load_environment calls this)."""
    import verifiers as vf
    from datasets import Dataset

    train, held_out = split_keys(random.Random(seed), train_keys)

    def rows(keys: list[str]) -> Dataset:
        return Dataset.from_list(
            [{"question": QUESTION.format(k), "answer": TABLE[k]} for k in keys]
        )

    return vf.ToolEnv(
        tools=[lookup],
        max_turns=max_turns,
        dataset=rows(train),
        eval_dataset=rows(held_out),
        rubric=vf.Rubric(funcs=[exact_answer]),
    )


def _field(message: Any, name: str) -> Any:
    """A message field, whether verifiers hands a dict or its pydantic message."""
    return message.get(name) if isinstance(message, dict) else getattr(message, name, None)
