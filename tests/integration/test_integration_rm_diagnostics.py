"""Reward-model diagnostics on the tiny demo task: rm_diagnostics.json after `rm`, the
length-bias figures of `eval` with a reward model, and a synthetic length counter run
through the trainer's own diagnostics code and flagged by its warning."""

from __future__ import annotations

import json

import pytest
import torch

from rlhf_dist.config import config_from_dict
from rlhf_dist.data.rows import load_rows
from rlhf_dist.demo import task
from rlhf_dist.evaluate import run_eval
from rlhf_dist.observability import diagnostics
from rlhf_dist.trainers import reward

REPORT_KEYS = {
    "accuracy",
    "loss",
    "ece",
    "pairs",
    "accuracy_by_category",
    "reliability",
    "score",
    "length",
    "rephrase",
    "thresholds",
    "warning",
}


def test_rm_writes_its_diagnostics(rm_run, task_env, read_jsonl):
    report = json.loads((rm_run.out / "rm_diagnostics.json").read_text())
    s = rm_run.summary
    assert report.keys() == REPORT_KEYS
    assert report["pairs"] == s["eval_pairs"] == 200
    assert report["accuracy"] == s["eval_accuracy"] and report["ece"] == s["eval_ece"]

    by_category = report["accuracy_by_category"]
    assert set(by_category) == {"all", *task.CATEGORIES}  # every demo category is held out too
    assert sum(v["pairs"] for k, v in by_category.items() if k != "all") == 200
    assert by_category["all"]["accuracy"] == s["eval_accuracy"]

    bins = report["reliability"]
    assert len(bins) == 10 and sum(b["pairs"] for b in bins) == 200
    assert diagnostics.ece_from_bins(bins) == pytest.approx(s["eval_ece"], abs=1e-9)

    # Lengths are of the RESPONSES (words + EOS with the word-level tokenizer), not of the
    # whole sequence: that checks the prompt/response split of reward.eval_pairs.
    rows = [json.loads(line) for line in task_env.files.prefs_eval.read_text().splitlines()]
    mean_chosen = sum(len(r["chosen"].split()) + 1 for r in rows) / len(rows)
    assert report["length"]["mean_chosen"] == pytest.approx(mean_chosen)
    assert -1.0 <= report["length"]["corr"] <= 1.0

    rephrase = report["rephrase"]
    assert rephrase["filler"] == " . that is all"  # the demo tokenizer's spelling
    assert rephrase["responses"] == 400  # independent random reviews: all distinct
    # Reviews that already end with the tail ". that is all" get a shorter version.
    assert 0 < rephrase["shorter_responses"] < 400

    # A model that learned the sentiment preference is not a length counter.
    assert report["warning"] is None, report["warning"]
    last = read_jsonl(rm_run.out / "metrics.jsonl")[-1]
    for name in ("length_corr", "rephrase_longer_delta", "rephrase_longer_rise"):
        assert last[f"rm/eval_{name}"] == s[f"eval_{name}"]


class LengthCounter(torch.nn.Module):
    """A "reward model" that counts tokens: at the last real token, the sequence length."""

    def forward(self, input_ids, attention_mask, position_ids=None):
        return attention_mask.float().cumsum(1)


class ListLogger:
    def __init__(self):
        self.rows = []

    def log(self, step, metrics, console_keys=()):
        self.rows.append((step, metrics))


def test_a_length_counter_is_flagged(rm_run, task_env, runtime, tmp_path, capsys):
    tokenizer = task_env.tokenizer
    rows = load_rows(str(task_env.files.prefs_eval), "data.eval")
    evals, prompt_lengths = reward.eval_pairs(rows, tokenizer, rm_run.cfg)
    logger = ListLogger()
    capsys.readouterr()
    summary = reward.report_eval(
        rm_run.cfg, runtime, LengthCounter(), tokenizer, evals, prompt_lengths, tmp_path, logger, 7
    )
    printed = capsys.readouterr().out.splitlines()
    report = json.loads((tmp_path / "rm_diagnostics.json").read_text())

    # The decision function on the numbers the trainer measured.
    warning = diagnostics.length_bias_warning(
        summary["eval_length_corr"],
        summary["eval_rephrase_longer_rise"],
        summary["eval_rephrase_longer_delta"],
        report["score"]["std"],
    )
    assert warning is not None and report["warning"] == warning
    assert summary["eval_length_corr"] > 0.9
    assert summary["eval_rephrase_longer_rise"] == 1.0
    assert summary["eval_rephrase_longer_delta"] == 4.0  # ". that is all" is 4 tokens
    assert summary["eval_rephrase_shorter_delta"] == 4.0
    # The labels follow sentiment, not length: the counter is no better than a coin.
    assert 0.35 < summary["eval_accuracy"] < 0.65
    assert [line for line in printed if "WARNING" in line] == [
        f"rm: WARNING: {warning} (see docs/rm_diagnostics.md)"
    ]
    assert logger.rows[0][0] == 7 and logger.rows[0][1]["rm/eval_length_corr"] > 0.9


def test_eval_with_a_reward_model_reports_its_length_bias(
    rm_run, sft_run, task_env, runtime, tmp_path, data_cfg, read_jsonl
):
    out = tmp_path / "eval_rm"
    cfg = config_from_dict(
        {
            "run": {"output_dir": str(out), "seed": 0},
            "model": {"policy": str(sft_run.out / "final"), "reward": str(rm_run.out / "final")},
            "data": data_cfg(train=str(task_env.files.eval_prompts)),
            "generation": {"max_new_tokens": 24, "temperature": 0.7},
            "eval": {"num_prompts": 16, "batch_size": 6},
        }
    )
    summary = run_eval(cfg, runtime)
    assert -1.0 <= summary["length_corr"] <= 1.0
    # Every finished sample is probed (the SFT policy finishes nearly all of them).
    assert summary["rephrase_responses"] == round(summary["eos_rate"] * 16)
    assert 0.0 <= summary["rephrase_longer_rise"] <= 1.0
    assert "rephrase_longer_delta" in summary
    row = read_jsonl(out / "metrics.jsonl")[0]
    assert row["eval/length_corr"] == summary["length_corr"]
    assert json.loads((out / "summary.json").read_text())["length_corr"] == summary["length_corr"]
