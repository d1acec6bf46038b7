"""GRPO on a reasoning-gym task (docs/grpo.md, "Verifiable tasks"), one iteration, as a user
runs it: from the command line (`rlhf-dist grpo data.train=reasoning_gym:basic_arithmetic?...
reward.functions=[rlhf_dist.rewards.tasks:reasoning_gym, ...]`, the installed console
script) and through the Python API (`rlhf_dist.grpo(config, reward_fn=tasks.reasoning_gym)`).

The command-line run has a recording reward beside the shipped ones, so the test sees
what reached the rewards: every completion came with its own row's prompt (reasoning-gym's
system prompt and the question) and columns (answer, metadata, task), those columns let the
task's scorer give the right answer 1.0, and the logged objective/score_reasoning_gym is
the scorer's mean over the completions; it also evaluates held-out rows (data.eval from
other seeds), whose questions are not training ones. The API run checks each logged
sample's score against the scorer.

The policy is a tiny random Llama with SmolLM2's tokenizer and chat template (as
test_integration_answer_column.py), so a run takes seconds; a random policy writes no
<answer> tags, so the shipped rewards score its completions 0 and the recording reward's
length term gives GRPO its gradient.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import rlhf_dist
from rlhf_dist.data.rows import load_rows
from rlhf_dist.rewards import tasks

REPO = Path(__file__).resolve().parents[2]
TRAIN = "reasoning_gym:basic_arithmetic?size=8&seed=0&max_terms=3"
HELD_OUT = "reasoning_gym:basic_arithmetic?size=4&seed=8&max_terms=3"
PROMPTS, SAMPLES = 2, 4
SIZES = {
    "run.log_every": 1,
    "run.progress": False,
    "run.eval_every": 1,
    "perf.num_threads": 1,
    "generation.max_new_tokens": 8,
    "ppo.iterations": 1,
    "ppo.rollout_batch_size": PROMPTS,
    "ppo.samples_per_prompt": SAMPLES,
    "ppo.optim.lr": 1e-3,
    "eval.num_prompts": 4,
}
RECORDER = """
import json


def record(prompts, responses, **columns):
    with open("calls.jsonl", "a", encoding="utf-8") as f:
        for i, (p, r) in enumerate(zip(prompts, responses)):
            row = {"prompt": p, "response": r, **{k: v[i] for k, v in columns.items()}}
            f.write(json.dumps(row) + "\\n")
    return [0.01 * len(r) for r in responses]
"""


@pytest.fixture(scope="module")
def policy(smollm2, tmp_path_factory) -> Path:
    from transformers import AutoTokenizer

    from rlhf_dist.demo import task

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2["shipped"]))
    root = tmp_path_factory.mktemp("tiny_smollm2")
    return task.build_tiny_models(root, tokenizer, size="tiny", seed=0)["policy"]


def run_cli(work: Path, *args: str) -> subprocess.CompletedProcess:
    """The installed `rlhf-dist ARGS` in `work` (PYTHONPATH: this checkout only)."""
    script = Path(sys.executable).parent / "rlhf-dist"
    found = str(script) if script.is_file() else shutil.which("rlhf-dist")
    assert found, "the rlhf-dist console script is not installed (pip install -e .)"
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env = base | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [found, *args], cwd=work, env=env, capture_output=True, text=True, timeout=240
    )


def as_json(value):
    return json.loads(json.dumps(value))  # tuples in metadata become lists, as recorded


@pytest.mark.slow
def test_cli_grpo_on_a_reasoning_gym_task_scores_with_the_tasks_scorer(
    policy, read_jsonl, tmp_path
):
    work, out = tmp_path / "work", tmp_path / "run"
    work.mkdir()
    (work / "recorder.py").write_text(RECORDER)
    rewards = "[rlhf_dist.rewards.tasks:reasoning_gym, rlhf_dist.rewards.tasks:answer_format, recorder:record]"  # fmt: skip
    overrides = [f"{k}={v}" for k, v in SIZES.items()]
    proc = run_cli(
        work, "grpo", f"model.policy={policy}", f"data.train={TRAIN}", f"data.eval={HELD_OUT}",
        f"reward.functions={rewards}", f"run.output_dir={out}", *overrides,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = {r["question"]: as_json(r) for r in load_rows(TRAIN, "data.train")}
    calls = read_jsonl(work / "calls.jsonl")
    train_calls = [c for c in calls if c["question"] in rows]
    eval_calls = [c for c in calls if c["question"] not in rows]
    assert len(train_calls) == PROMPTS * SAMPLES and len(eval_calls) == 4
    for call in train_calls:
        row = rows[call["question"]]
        assert {k: call[k] for k in row} == row  # prompt, question, answer, metadata, task
    held_out = {r["question"] for r in load_rows(HELD_OUT, "data.eval")}
    assert {c["question"] for c in eval_calls} <= held_out
    columns = {k: [c[k] for c in train_calls] for k in ("task", "answer", "metadata", "question")}
    oracle = [f"<answer>{a}</answer>" for a in columns["answer"]]
    assert tasks.reasoning_gym(None, oracle, **columns) == [1.0] * len(train_calls)
    scores = tasks.reasoning_gym(None, [c["response"] for c in train_calls], **columns)
    trained, evaluated = read_jsonl(out / "metrics.jsonl")  # iteration 1, then its eval
    assert trained["objective/score_reasoning_gym"] == pytest.approx(sum(scores) / len(scores))
    assert "objective/score_answer_format" in trained
    assert "eval/score_reasoning_gym" in evaluated
    assert f"train: {TRAIN}" in (out / "config.yaml").read_text()


def test_python_api_grpo_with_the_shipped_reward_function(policy, read_jsonl, tmp_path):
    out = tmp_path / "run"
    summary = rlhf_dist.grpo(
        {
            **SIZES,
            "model.policy": str(policy),
            "data.train": TRAIN,
            "data.eval": HELD_OUT,
            "run.output_dir": str(out),
            "run.samples_every": 1,
            "run.eval_every": 0,
        },
        reward_fn=tasks.reasoning_gym,
    )
    assert summary["iterations"] == 1
    # The shipped function is recorded by its module:name, as the command line names it.
    assert "function: rlhf_dist.rewards.tasks:reasoning_gym" in (out / "config.yaml").read_text()
    rows = load_rows(TRAIN, "data.train")
    samples = read_jsonl(out / "samples.jsonl")
    assert len(samples) == PROMPTS * SAMPLES
    for sample in samples:  # the prompt as readable text holds its row's question
        (row,) = [r for r in rows if r["question"] in sample["prompt"]]
        columns = {k: [row[k]] for k in ("task", "answer", "metadata", "question")}
        assert [sample["score"]] == tasks.reasoning_gym(None, [sample["response"]], **columns)
    (metrics,) = read_jsonl(out / "metrics.jsonl")
    assert metrics["objective/raw_score"] == pytest.approx(
        sum(s["score"] for s in samples) / len(samples)
    )
