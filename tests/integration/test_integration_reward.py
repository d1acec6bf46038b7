"""Reward model on the tiny demo task: it learns the sentiment preference, reports accuracy
and calibration, and exports a checkpoint that plain transformers loads and scores with."""

from __future__ import annotations

import json
import math
import random

import torch

from rlhf_dist.config import config_from_dict
from rlhf_dist.data.rows import collate_pairs, load_rows, preference_pairs
from rlhf_dist.demo import task
from rlhf_dist.trainers.reward import train_reward_model


def test_reward_model_learns_the_preference(rm_run):
    s = rm_run.summary
    # Labels are Bradley-Terry noisy (the Bayes-optimal accuracy is ~0.87 on these pairs);
    # chance is 0.5. 32 steps from the SFT backbone reach ~0.84.
    assert s["eval_accuracy"] > 0.75, s
    assert s["eval_pairs"] == 200
    assert 0.0 <= s["eval_ece"] <= 1.0 and math.isfinite(s["eval_ece"])
    assert s["eval_loss"] < math.log(2), "no better than a constant score"
    on_disk = json.loads((rm_run.out / "summary.json").read_text())
    assert {"eval_accuracy", "eval_ece", "steps", "train_pairs"} <= on_disk.keys()
    assert on_disk["eval_accuracy"] == s["eval_accuracy"]


def test_reward_model_export_is_the_trained_model(rm_run, task_env):
    from transformers import AutoModelForSequenceClassification

    trained = rm_run.trained
    exported = AutoModelForSequenceClassification.from_pretrained(
        rm_run.out / "final", num_labels=1
    )
    exported.eval()
    assert exported.config.num_labels == 1
    # The head is what the RM stage trains from scratch; it must be the trained one,
    # not a re-initialised head (OpenRLHF #209/#428).
    assert torch.equal(exported.score.weight, trained.score.weight.detach())
    for name, value in trained.state_dict().items():
        assert torch.equal(exported.state_dict()[name], value), name

    # Users score with the stock forward (the head read at the last non-PAD token). Held-out
    # pairs scored that way must give the accuracy the trainer reported.
    rows = load_rows(str(task_env.files.prefs_eval), "data.eval")
    pairs, _ = preference_pairs(rows, task_env.tokenizer, rm_run.cfg.data)
    batch = collate_pairs(pairs, task_env.tokenizer.pad_token_id)
    with torch.no_grad():
        scores = exported(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).logits.squeeze(-1)
    chosen, rejected = scores[: len(pairs)], scores[len(pairs) :]
    accuracy = (chosen > rejected).float().mean().item()
    assert abs(accuracy - rm_run.summary["eval_accuracy"]) < 1e-6


def test_reward_model_trains_on_ranked_lists(task_env, runtime, tmp_path, read_jsonl):
    # A ranked-list file: three responses per prompt, best first by the gold reward.
    rng = random.Random(7)
    path = tmp_path / "ranked.jsonl"
    n_rows = 32
    with path.open("w", encoding="utf-8") as f:
        for _ in range(n_rows):
            prompt, category = task.make_prompt(rng)
            # Mostly positive, mixed, mostly negative; sorted by the gold reward anyway.
            responses = [task.sample_response(rng, category, p) for p in (0.9, 0.5, 0.1)]
            responses.sort(key=task.gold_reward, reverse=True)
            f.write(json.dumps({"prompt": prompt, "responses": responses}) + "\n")
    out = tmp_path / "rm_ranked"
    cfg = config_from_dict(
        {
            "run": {"output_dir": str(out), "log_every": 1},
            "model": {"reward": str(task_env.reward)},
            "data": {"train": str(path), "max_prompt_length": 16, "max_length": 48},
            "rm": {"epochs": 1, "batch_size": 16, "micro_batch_size": 8},
        }
    )
    summary = train_reward_model(cfg, runtime)
    # Each list of 3 expands to C(3, 2) = 3 pairs: (1st, 2nd), (1st, 3rd), (2nd, 3rd).
    assert summary["train_pairs"] == 3 * n_rows
    assert summary["steps"] == 3 * n_rows // 16
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, summary["steps"] + 1))
    assert all(math.isfinite(r["rm/loss"]) for r in rows)
    assert (out / "final" / "config.json").is_file()
