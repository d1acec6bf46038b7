"""The starter file runs as written: `rlhf-dist config --yaml grpo > grpo.yaml`, a
prompts.jsonl with an `answer` column and a rewards.py beside it (the names the file
gives: data.train prompts.jsonl, reward.function rewards:accuracy, output in runs/grpo),
then `rlhf-dist grpo --config grpo.yaml` in that directory trains the real SmolLM2-135M-
Instruct. Only model.policy is replaced (the file names the Hub's copy; the Hub is not
reachable here) and the run is cut to CPU size on the command line: one iteration of one
prompt, 8 new tokens. Every other key, the grpo preset's 8 samples per prompt and its
1e-6 learning rate included, is the file's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

REPO = Path(__file__).resolve().parents[2]
PROBE = "model.layers.29.mlp.down_proj.weight"
# What a TRL user writes: the reward reads the row's answer; a conversational completion
# is one assistant message. The length term makes the 8 samples' scores differ, so GRPO
# has a gradient even when none is right. Each call is recorded in calls.jsonl.
REWARDS = """
import json


def accuracy(prompts, completions, answer, **kwargs):
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    scores = [float(a in t) - 0.001 * len(t) for t, a in zip(texts, answer)]
    with open("calls.jsonl", "a", encoding="utf-8") as f:
        for p, a, s in zip(prompts, answer, scores):
            f.write(json.dumps({"prompt": p, "answer": a, "score": s}) + "\\n")
    return scores
"""
QUESTIONS = [(2, 3), (4, 4), (1, 6), (5, 4)]


def console_script() -> str:
    """The `rlhf-dist` entry point installed beside this interpreter (else on PATH)."""
    beside = Path(sys.executable).parent / "rlhf-dist"
    found = str(beside) if beside.is_file() else shutil.which("rlhf-dist")
    if found is None:
        pytest.fail("the rlhf-dist console script is not installed (pip install -e .)")
    return found


def run_cli(work: Path, *args: str) -> subprocess.CompletedProcess:
    """`rlhf-dist ARGS` run in `work` as a user would (this checkout on PYTHONPATH)."""
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env = base | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [console_script(), *args], cwd=work, env=env, capture_output=True, text=True, timeout=300
    )


def _probe(model_dir: Path):
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return f.get_tensor(PROBE)


@pytest.mark.slow
def test_the_grpo_starter_file_trains_the_real_model_as_written(smollm2, read_jsonl, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    written = run_cli(work, "config", "--yaml", "grpo")
    assert written.returncode == 0, written.stderr[-3000:]
    (work / "grpo.yaml").write_text(written.stdout, encoding="utf-8")
    rows = [
        {"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}
        for a, b in QUESTIONS
    ]
    (work / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (work / "rewards.py").write_text(REWARDS)
    base = smollm2["shipped"]
    proc = run_cli(
        work, "grpo", "--config", "grpo.yaml", f"model.policy={base}",
        "ppo.iterations=1", "ppo.rollout_batch_size=1", "generation.max_new_tokens=8",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = work / "runs" / "grpo"  # the file's run.output_dir
    (metrics,) = read_jsonl(out / "metrics.jsonl")
    assert metrics["step"] == 1 and metrics["guard/skipped_steps"] == 0
    # the preset's group of 8 samples of one prompt, each scored with that prompt's answer
    calls = read_jsonl(work / "calls.jsonl")
    answers = {json.dumps(r["prompt"]): r["answer"] for r in rows}
    assert len(calls) == 8 and len({json.dumps(c["prompt"]) for c in calls}) == 1
    assert all(c["answer"] == answers[json.dumps(c["prompt"])] for c in calls)
    assert metrics["objective/raw_score"] == pytest.approx(
        sum(c["score"] for c in calls) / 8, abs=1e-5
    )
    assert not (_probe(out / "final") == _probe(base)).all(), "the actor did not train"
