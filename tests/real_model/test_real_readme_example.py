"""README.md's GRPO example runs as written on the real SmolLM2-135M-Instruct.

The python block after the marker `<!-- example: grpo-answers -->` is executed in a fresh
working directory with one change: the hub name of the model becomes the local copy (the
`smollm2` fixture; the hub is unreachable here). rlhf_dist.grpo is wrapped only to watch the
reward calls, so a reward that never saw the rows' `answer` column fails the test.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest

import rlhf_dist

README = Path(__file__).resolve().parents[2] / "README.md"
MARKER = "<!-- example: grpo-answers -->"
HUB_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


def example_code() -> str:
    """The python block that directly follows the marker."""
    text = README.read_text(encoding="utf-8")
    assert text.count(MARKER) == 1, f"README.md needs exactly one {MARKER}"
    found = re.match(r"\s*```python\n(.*?)\n```", text.split(MARKER, 1)[1], re.S)
    assert found, f"no python block right after {MARKER}"
    return found.group(1)


def test_the_example_block_is_found():
    code = example_code()
    assert code.count(f'"{HUB_NAME}"') == 1, "the example names the model once"
    assert "rlhf_dist.grpo(" in code and "answer" in code


def watching_grpo(calls: list[dict]):
    """rlhf_dist.grpo with its reward function wrapped to record each call's arguments
    (functools.wraps keeps the signature, so the columns it is given stay the same)."""
    real = rlhf_dist.grpo

    def grpo(config=None, *, reward_fn=None, **kwargs):
        @functools.wraps(reward_fn)
        def watched(*args, **named):
            calls.append({"args": args, **named})
            return reward_fn(*args, **named)

        return real(config, reward_fn=watched, **kwargs)

    return grpo


@pytest.mark.slow
def test_the_readme_grpo_example_runs_on_the_real_model(smollm2, tmp_path, monkeypatch):
    code = example_code().replace(f'"{HUB_NAME}"', repr(str(smollm2["shipped"])))
    calls: list[dict] = []
    monkeypatch.setattr(rlhf_dist, "grpo", watching_grpo(calls))
    monkeypatch.chdir(tmp_path)
    # One thread: a single process's OpenMP threads on shared cores spin-wait on each other.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    namespace: dict = {"__name__": "__main__"}
    exec(compile(code, f"{README}:{MARKER}", "exec"), namespace)

    summary = namespace["summary"]
    out = tmp_path / "runs" / "grpo-answers"
    assert summary == json.loads((out / "summary.json").read_text())
    assert summary["iterations"] >= 1 and summary["episodes"] > 0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in metrics] == list(range(1, summary["iterations"] + 1))
    assert all(0.0 <= row["objective/score"] <= 1.0 for row in metrics)
    assert (out / "final" / "model.safetensors").is_file()
    assert (out / "final" / "README.md").is_file(), "the model card"

    # The reward saw each sampled row's own answer, TRL-style (keywords, chat completions).
    answer_of = {row["prompt"][0]["content"]: row["answer"] for row in namespace["rows"]}
    assert len(calls) == summary["iterations"], "one reward call per iteration"
    for call in calls:
        assert not call["args"], "TRL's form is called by keyword"
        prompts, completions, answers = call["prompts"], call["completions"], call["answer"]
        assert len(prompts) == len(completions) == len(answers) > 0
        assert answers == [answer_of[p[0]["content"]] for p in prompts]
        assert all(c[0]["role"] == "assistant" for c in completions)
