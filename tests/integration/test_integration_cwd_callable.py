"""`rlhf-dist eval reward.function=my_rewards:score` started through the installed console
script, from a directory holding my_rewards.py: the script (unlike `python -m rlhf_dist`)
does not put the working directory on sys.path, yet the user's module is found."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
USER_MODULE = """
def score(prompts, responses):
    return [0.375 for _ in responses]


def gold(prompts, responses, finished):
    return [0.625 for _ in responses]
"""


def console_script() -> str:
    """The `rlhf-dist` entry point installed beside this interpreter (else on PATH)."""
    beside = Path(sys.executable).parent / "rlhf-dist"
    found = str(beside) if beside.is_file() else shutil.which("rlhf-dist")
    if found is None:
        pytest.skip("the rlhf-dist console script is not installed")
    return found


@pytest.mark.slow
def test_console_script_finds_reward_and_gold_functions_in_the_working_directory(
    task_env, tmp_path
):
    work = tmp_path / "work"
    work.mkdir()
    (work / "my_rewards.py").write_text(USER_MODULE)
    out = tmp_path / "eval"
    args = [
        console_script(), "eval", "run.progress=false", f"run.output_dir={out}",
        f"model.policy={task_env.policy}", f"data.train={task_env.prompts}",
        "reward.function=my_rewards:score", "eval.gold_function=my_rewards:gold",
        "eval.num_prompts=4", "eval.batch_size=4", "generation.max_new_tokens=4",
    ]  # fmt: skip
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    # PYTHONPATH: the installed script runs this checkout's code; it does not add `work`.
    env = base | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(args, cwd=work, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["score"] == pytest.approx(0.375)
    assert summary["gold_reward"] == pytest.approx(0.625)
