"""GRPO whose reward function reads each row's `answer` column (docs/rewards.md), end to
end as a TRL user runs it: from the command line, with the reward module beside the data
in the working directory (`rlhf-dist grpo --config grpo.yaml reward.function=mymodule:
accuracy`, the installed console script, which does not put the working directory on
sys.path), and through the Python API (`rlhf_dist.grpo(config, dataset=rows,
reward_fn=fn)`). Each test records every call of the reward function and checks that
every completion came with the answer (and the other columns) of the row its prompt came
from, that each prompt of an iteration was sampled samples_per_prompt times, that the
scores the function returned are the ones the run logged, and that the actor trained.

The policy is a tiny random Llama carrying SmolLM2's real tokenizer (its 49,152-token
vocabulary, ChatML template and PAD == EOS), so a run takes seconds; the real weights run
the starter file (test_integration_starter.py) and the shipped 8-GPU config
(tests/distributed/test_dist_grpo_shipped.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import rlhf_dist
from rlhf_dist.rewards.scoring import TRL_ARGUMENTS

REPO = Path(__file__).resolve().parents[2]
# Distinct answers, so an answer names the row it came from.
SUMS = [(2, 3), (4, 4), (1, 6), (5, 4), (3, 3), (7, 3)]
ITERATIONS, PROMPTS_PER_ITERATION, SAMPLES = 2, 2, 4
SIZES = {
    "run.log_every": 1,
    "run.progress": False,
    "perf.num_threads": 1,
    "data.max_prompt_length": 48,
    "data.max_length": 64,
    "generation.max_new_tokens": 8,
    "ppo.iterations": ITERATIONS,
    "ppo.rollout_batch_size": PROMPTS_PER_ITERATION,
    "ppo.samples_per_prompt": SAMPLES,
    "ppo.optim.lr": 1e-3,
}
# The user's module, in TRL's convention: a conversational completion is one assistant
# message. It appends what it was given to calls.jsonl in the working directory. The
# length term makes a group's scores differ, so GRPO has a gradient when none is right.
MODULE = """
import json


def accuracy(prompts, completions, answer, **kwargs):
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    scores = [float(t.strip() == a) - 0.01 * len(t) for t, a in zip(texts, answer)]
    with open("calls.jsonl", "a", encoding="utf-8") as f:
        for i, (p, c, a, s) in enumerate(zip(prompts, completions, answer, scores)):
            # **kwargs receive TRL's run keywords too (trainer_state, ...): not columns
            extra = {k: v[i] for k, v in kwargs.items() if isinstance(v, list)}
            f.write(json.dumps({"prompt": p, "completion": c, "answer": a, "extra": extra,
                                "score": s}) + "\\n")
    return scores
"""


def chat_rows() -> list[dict]:
    return [
        {
            "prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
            "answer": str(a + b),
            "level": i,
        }
        for i, (a, b) in enumerate(SUMS)
    ]


def text_rows() -> list[dict]:
    return [
        {"prompt": f"Question: what is {a} + {b}?\nAnswer:", "answer": str(a + b), "level": i}
        for i, (a, b) in enumerate(SUMS)
    ]


@pytest.fixture(scope="module")
def policy(smollm2, tmp_path_factory) -> Path:
    """A tiny random Llama saved with SmolLM2's tokenizer as it ships."""
    from transformers import AutoTokenizer

    from rlhf_dist.demo import task

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2["shipped"]))
    root = tmp_path_factory.mktemp("tiny_smollm2")
    return task.build_tiny_models(root, tokenizer, size="tiny", seed=0)["policy"]


def console_script() -> str:
    """The `rlhf-dist` entry point installed beside this interpreter (else on PATH)."""
    beside = Path(sys.executable).parent / "rlhf-dist"
    found = str(beside) if beside.is_file() else shutil.which("rlhf-dist")
    if found is None:
        pytest.fail("the rlhf-dist console script is not installed (pip install -e .)")
    return found


def run_cli(work: Path, *args: str) -> subprocess.CompletedProcess:
    """`rlhf-dist ARGS` in `work`; PYTHONPATH holds this checkout only, not `work`."""
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env = base | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [console_script(), *args], cwd=work, env=env, capture_output=True, text=True, timeout=240
    )


def key(prompt) -> str:
    return json.dumps(prompt, sort_keys=True)


def check_calls(calls: list[dict], rows: list[dict], metrics: list[dict]) -> None:
    """Every completion came with its own row's answer and level; each iteration sampled
    PROMPTS_PER_ITERATION prompts SAMPLES times each; the logged raw score is the mean of
    what the function returned."""
    by_prompt = {key(r["prompt"]): r for r in rows}
    per_iteration = PROMPTS_PER_ITERATION * SAMPLES
    assert len(calls) == ITERATIONS * per_iteration
    for call in calls:
        row = by_prompt[key(call["prompt"])]
        # **kwargs also receive what TRL passes every reward (completion_ids, ...)
        columns = {k: v for k, v in call["extra"].items() if k not in TRL_ARGUMENTS}
        assert (call["answer"], columns) == (row["answer"], {"level": row["level"]})
    assert [m["step"] for m in metrics] == list(range(1, ITERATIONS + 1))
    for it, m in enumerate(metrics):
        chunk = calls[it * per_iteration : (it + 1) * per_iteration]
        counts = Counter(key(c["prompt"]) for c in chunk)
        assert sorted(counts.values()) == [SAMPLES] * PROMPTS_PER_ITERATION
        mean = sum(c["score"] for c in chunk) / len(chunk)
        assert m["objective/raw_score"] == pytest.approx(mean, abs=1e-5)
        assert m["guard/skipped_steps"] == 0


def assert_trained(policy: Path, out: Path) -> None:
    before = load_file(str(policy / "model.safetensors"))
    after = load_file(str(out / "final" / "model.safetensors"))
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before), "the actor did not train"


@pytest.mark.slow
def test_cli_reward_module_in_the_working_directory_reads_the_answer_column(
    policy, read_jsonl, tmp_path
):
    work = tmp_path / "work"
    work.mkdir()
    rows = chat_rows()
    (work / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (work / "mymodule.py").write_text(MODULE)
    tree: dict = {}
    for dotted, value in {**SIZES, "model.policy": str(policy)}.items():
        *parents, name = dotted.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[name] = value
    (work / "grpo.yaml").write_text(json.dumps(tree, indent=1))  # JSON is YAML
    out = tmp_path / "run"
    proc = run_cli(
        work, "grpo", "--config", "grpo.yaml", "reward.function=mymodule:accuracy",
        "data.train=prompts.jsonl", f"run.output_dir={out}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    calls = read_jsonl(work / "calls.jsonl")
    # TRL's convention for a conversational prompt: the completion is one assistant message
    assert all(c["completion"][0]["role"] == "assistant" for c in calls)
    check_calls(calls, rows, read_jsonl(out / "metrics.jsonl"))
    effective = (out / "config.yaml").read_text()
    assert "estimator: grpo" in effective and "function: mymodule:accuracy" in effective
    assert_trained(policy, out)


def test_python_api_reward_fn_reads_the_answer_column(policy, read_jsonl, tmp_path):
    calls: list[dict] = []

    def accuracy(prompts, responses, answer, level):  # our convention, named columns only
        scores = [float(r.strip() == a) - 0.01 * len(r) for r, a in zip(responses, answer)]
        for p, a, lv, s in zip(prompts, answer, level, scores):
            calls.append({"prompt": p, "answer": a, "extra": {"level": lv}, "score": s})
        assert all(isinstance(r, str) for r in responses)  # text prompts: text responses
        return scores

    rows = text_rows()
    out = tmp_path / "run"
    summary = rlhf_dist.grpo(
        {**SIZES, "model.policy": str(policy), "run.output_dir": str(out)},
        dataset=rows,
        reward_fn=accuracy,
    )
    assert summary["iterations"] == ITERATIONS
    check_calls(calls, rows, read_jsonl(out / "metrics.jsonl"))
    assert_trained(policy, out)


def test_a_reward_naming_a_column_the_data_lacks_fails_before_any_model_loads(smollm2, tmp_path):
    # The "policy" is SmolLM2's tokenizer alone: loading a model from it would fail with
    # another error, so the one line below proves the check ran before any model loads.
    policy = tmp_path / "tokenizer_only"
    policy.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smollm2["shipped"] / name, policy / name)
    work = tmp_path / "work"
    work.mkdir()
    rows = [{k: v for k, v in r.items() if k != "answer"} for r in chat_rows()]
    (work / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (work / "mymodule.py").write_text(MODULE)
    out = tmp_path / "run"
    proc = run_cli(
        work, "grpo", f"model.policy={policy}", "data.train=prompts.jsonl",
        "reward.function=mymodule:accuracy", "ppo.rollout_batch_size=2",
        f"run.output_dir={out}",
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-4000:]
    lines = proc.stderr.strip().splitlines()
    assert lines == [
        "rlhf-dist grpo: error: reward.function: mymodule:accuracy needs the column(s) answer, which "
        "data.train 'prompts.jsonl' does not have (it has: level)"
    ], proc.stderr[-4000:]
    assert not (work / "calls.jsonl").exists() and not out.exists()
