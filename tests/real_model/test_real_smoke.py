"""A real chat model as it ships, end to end: SmolLM2-135M-Instruct with its tokenizer as
shipped (PAD == EOS; the no-PAD and distinct-PAD conventions run every stage on tiny
Llamas carrying the real tokenizer, test_real_stages.py), through the Python API (rlhf_dist.api) on
TRL-format conversational data: SFT on `messages` rows (a datasets.Dataset), then DPO on
conversational pairs. (GRPO on the real weights through the API, with message-list prompts
and the rows' `answer` column, is README's example: test_real_readme_example.py.) Then a
GRPO run through the command line with a `module:callable` reward logs the same
metrics as the API run with a closure (on a tiny Llama carrying the real tokenizer and
template: the equality needs the real data path, not the real weights).

Step counts are the smallest that train: this checks that every stage runs and learns
something on a real 49,152-token vocabulary and ChatML template, not how well.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import rlhf_dist
from rlhf_dist.demo import task

REPO = Path(__file__).resolve().parents[2]
PROBE = "model.layers.29.mlp.down_proj.weight"  # the last layer: trained by every stage

COMMON = {
    "run.progress": False,
    "run.log_every": 1,
    "perf.num_threads": 2,
    "data.max_length": 96,
    "data.max_prompt_length": 56,
}
GRPO = {
    "ppo.estimator": "grpo",
    "ppo.iterations": 2,
    "ppo.samples_per_prompt": 2,
    "ppo.rollout_batch_size": 2,
    "ppo.rollout_micro_batch_size": 4,
    "ppo.minibatch_size": 4,
    "ppo.micro_batch_size": 4,
    "ppo.ppo_epochs": 1,
    "ppo.kl_placement": "loss",
    "ppo.kl_kind": "k3",
    "ppo.kl_coef": 0.04,
    "ppo.optim.lr": 1e-5,
    "generation.max_new_tokens": 12,
    "generation.temperature": 1.0,
}


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def _probe(model_dir: Path) -> torch.Tensor:
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return f.get_tensor(PROBE)


@pytest.mark.slow
def test_sft_then_dpo_on_the_real_model_through_the_api(smollm2, chat_files, tmp_path):
    import datasets
    from transformers import AutoTokenizer

    base = smollm2["shipped"]
    shipped_pad = AutoTokenizer.from_pretrained(str(base)).pad_token_id
    sft_rows = datasets.Dataset.from_list(_rows(chat_files["sft"])[:4])
    # sft.optim.lr: the default (1e-3) suits the demo's random-init models, not a real one.
    rlhf_dist.sft({**COMMON, "model.policy": str(base), "run.output_dir": str(tmp_path / "sft"),
                   "sft.batch_size": 4, "sft.micro_batch_size": 4, "sft.optim.lr": 2e-5},
                  dataset=sft_rows)  # fmt: skip
    sft_final = tmp_path / "sft" / "final"
    assert not torch.equal(_probe(sft_final), _probe(base)), "SFT changed no weight"
    assert AutoTokenizer.from_pretrained(str(sft_final)).pad_token_id == shipped_pad

    pairs = tmp_path / "pairs.jsonl"  # one step of 4 conversational pairs
    pairs.write_text("".join(chat_files["prefs"].read_text(encoding="utf-8").splitlines(True)[:4]))
    rlhf_dist.dpo({**COMMON, "model.policy": str(sft_final), "run.output_dir": str(tmp_path / "dpo"),
                   "dpo.batch_size": 4, "dpo.micro_batch_size": 4, "dpo.optim.lr": 1e-6},
                  overrides=[f"data.train={pairs}"])  # fmt: skip
    (step,) = [r for r in _rows(tmp_path / "dpo" / "metrics.jsonl") if "dpo/loss" in r]
    assert abs(step["dpo/loss"] - 0.6931) < 1e-3  # the policy is its own reference at step 1
    assert not torch.equal(_probe(tmp_path / "dpo" / "final"), _probe(sft_final))


def _training_rows(out: Path) -> list[dict]:
    """metrics.jsonl without wall-clock and memory figures (time/*, throughput/*, memory/*)."""
    return [
        {k: v for k, v in row.items() if not k.startswith(("time/", "throughput/", "memory/"))}
        for row in _rows(out / "metrics.jsonl")
    ]


@pytest.mark.slow
def test_the_api_with_a_closure_logs_what_the_cli_logs(tiny_real_vocab, chat_files, tmp_path):
    base = str(tiny_real_vocab["shipped"]["policy"])
    keys = {**COMMON, **GRPO, "model.policy": base, "data.train": str(chat_files["prompts"])}
    cli_out, api_out = tmp_path / "cli", tmp_path / "api"
    overrides = [f"{k}={v}" for k, v in keys.items()]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="2")
    proc = subprocess.run(
        [sys.executable, "-m", "rlhf_dist", "ppo", *overrides, f"run.output_dir={cli_out}",
         "reward.function=rlhf_dist.demo.task:gold_reward_fn"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rlhf_dist.ppo(
        {**keys, "run.output_dir": str(api_out)},
        reward_fn=lambda prompts, responses: task.gold_reward_fn(prompts, responses),
    )
    cli, api = _training_rows(cli_out), _training_rows(api_out)
    assert len(cli) == len(api) >= 2
    assert cli == api
