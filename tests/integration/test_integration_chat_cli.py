"""`rlhf-dist sft`, `rm` and `ppo` from the command line on conversational files in TRL's
formats, with no config beyond paths and tiny step counts (issue 12).

The tiny Llama's tokenizer carries a ChatML template (the demo's "chatml" chat tokenizer),
so nothing about chat templates or stop tokens is configured: SFT reads `messages` rows,
the reward model starts from the SFT export and reads `chosen`/`rejected` message lists
with an implicit prompt, and PPO starts from both exports and reads prompts as message
lists. Real subprocesses (`python -m rlhf_dist`), because what a user runs is the contract.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from chat_tokenizers import build_chat_tokenizer

from rlhf_dist.demo import task

REPO = Path(__file__).resolve().parents[2]
N_ROWS = 32  # one optimizer step of the default sft.batch_size / rm.batch_size


def _write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _trl_files(root: Path) -> dict[str, str]:
    """One file per stage, each in TRL's conversational format for it."""
    rng = random.Random(0)
    sft, prefs, prompts = [], [], []
    for _ in range(N_ROWS):
        prompt, category = task.make_prompt(rng)
        user = [{"role": "user", "content": prompt}]
        good = {"role": "assistant", "content": task.sample_response(rng, category, 0.9)}
        bad = {"role": "assistant", "content": task.sample_response(rng, category, 0.1)}
        sft.append({"messages": [{"role": "system", "content": "review"}, *user, good]})
        prefs.append({"chosen": [*user, good], "rejected": [*user, bad]})  # implicit prompt
        prompts.append({"prompt": user})
    return {
        "sft": _write(root / "sft.jsonl", sft),
        "rm": _write(root / "prefs.jsonl", prefs),
        "ppo": _write(root / "prompts.jsonl", prompts),
    }


def _cli(stage: str, *overrides: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "rlhf_dist", stage, "run.progress=false", *overrides]
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env = base | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"rlhf-dist {stage} failed:\n{proc.stderr[-3000:]}"
    return proc


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


@pytest.mark.slow
def test_sft_rm_ppo_from_the_cli_on_trl_conversational_files(tmp_path):
    tokenizer = build_chat_tokenizer(tmp_path / "tok", "chatml")
    base = task.build_tiny_models(tmp_path / "models", tokenizer, seed=0)["policy"]
    files, out = _trl_files(tmp_path), {s: tmp_path / s for s in ("sft", "rm", "ppo")}

    proc = _cli("sft", f"model.policy={base}", f"data.train={files['sft']}",
                f"run.output_dir={out['sft']}")  # fmt: skip
    assert f"sft data: {N_ROWS} kept" in proc.stdout
    sft_final = out["sft"] / "final"
    assert (sft_final / "model.safetensors").is_file()
    assert any("sft/loss" in r for r in _rows(out["sft"] / "metrics.jsonl"))

    proc = _cli("rm", f"model.policy={sft_final}", f"data.train={files['rm']}",
                f"run.output_dir={out['rm']}")  # fmt: skip
    assert f"preference pairs: {N_ROWS} kept" in proc.stdout
    assert json.loads((out["rm"] / "summary.json").read_text())["train_pairs"] == N_ROWS
    assert (out["rm"] / "final" / "model.safetensors").is_file()

    _cli("ppo", f"model.policy={sft_final}", f"model.reward={out['rm'] / 'final'}",
         f"data.train={files['ppo']}", f"run.output_dir={out['ppo']}", "ppo.iterations=1",
         "ppo.rollout_batch_size=16", "ppo.rollout_micro_batch_size=16", "ppo.ppo_epochs=1",
         "generation.max_new_tokens=8")  # fmt: skip
    metrics = [r for r in _rows(out["ppo"] / "metrics.jsonl") if "objective/score" in r]
    assert len(metrics) == 1 and metrics[0]["rollout/sequences"] == 16
    for name in ("objective/kl", "policy/loss", "value/loss"):
        assert metrics[0][name] == metrics[0][name], name  # present and not NaN
    assert (out["ppo"] / "final" / "model.safetensors").is_file()
    assert (out["ppo"] / "critic" / "model.safetensors").is_file()
    # Every export still carries the template, so the next stage needs no config either.
    for final in (sft_final, out["rm"] / "final", out["ppo"] / "final"):
        saved = json.loads((final / "tokenizer_config.json").read_text())
        jinja = final / "chat_template.jinja"
        template = jinja.read_text() if jinja.is_file() else saved.get("chat_template")
        assert template == tokenizer.chat_template, final
