"""run.eval_every: the held-out evaluation during training, logged as eval/<name> rows of
metrics.jsonl with the step (docs/metrics.md), in every stage.

- SFT: the held-out NLL at every step, the last one the same number as the end-of-run
  evaluation (the same weights, the same eval_nll);
- GRPO: `rlhf-dist eval`'s score, KL to the reference and gold reward on at most
  eval.num_prompts data.eval prompts at every iteration, and the training run draws the
  same numbers as without the evaluation (its RNG streams are put back);
- RM, DPO, KTO: their held-out figures at every step;
- KTO's held-out evaluation of a policy against itself is exact: every log-ratio is 0.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from spies import capture_calls

from rlhf_dist import evaluate
from rlhf_dist.config import config_from_dict
from rlhf_dist.trainers.dpo import train_dpo
from rlhf_dist.trainers.kto import evaluate_kto, train_kto
from rlhf_dist.trainers.ppo import train_ppo
from rlhf_dist.trainers.reward import train_reward_model
from rlhf_dist.trainers.sft import train_sft

GOLD = "rlhf_dist.demo.task:gold_reward_eval"
POSITIVE_REWARD = "rlhf_dist.demo.task:positive_word_reward"


def _split(source: Path, root: Path, n_train: int, n_eval: int) -> tuple[str, str]:
    """The first n_train rows of `source` as a train file, the next n_eval as held-out."""
    lines = source.read_text(encoding="utf-8").splitlines(keepends=True)
    train, held_out = root / f"train_{source.name}", root / f"eval_{source.name}"
    train.write_text("".join(lines[:n_train]), encoding="utf-8")
    held_out.write_text("".join(lines[n_train : n_train + n_eval]), encoding="utf-8")
    return str(train), str(held_out)


def _eval_rows(rows: list[dict]) -> dict[int, dict]:
    """step -> the eval/ row of that step (exactly one per step)."""
    found = [r for r in rows if any(k.startswith("eval/") for k in r)]
    assert len({r["step"] for r in found}) == len(found), "one eval row per step"
    return {r["step"]: r for r in found}


def test_sft_logs_held_out_nll_at_every_step(task_env, runtime, tmp_path, data_cfg, read_jsonl):
    train, held_out = _split(task_env.files.sft, tmp_path, 64, 24)
    out = tmp_path / "sft"
    cfg = config_from_dict(
        {
            "run": {"output_dir": str(out), "seed": 0, "log_every": 2, "eval_every": 1},
            "model": {"policy": str(task_env.policy)},
            "data": data_cfg(train=train, eval=held_out),
            "sft": {"epochs": 1, "batch_size": 16, "micro_batch_size": 8, "optim": {"lr": 3e-3}},
        }
    )
    summary = train_sft(cfg, runtime)
    evals = _eval_rows(read_jsonl(out / "metrics.jsonl"))
    assert sorted(evals) == [1, 2, 3, 4]
    losses = [evals[s]["eval/loss"] for s in (1, 2, 3, 4)]
    assert all(math.isfinite(x) for x in losses)
    # A random-init model fitting reviews: the held-out NLL falls from the first step on.
    assert losses[-1] < losses[0]
    # The last periodic evaluation saw the final weights: the end-of-run number, exactly.
    assert losses[-1] == summary["eval_loss"]


def grpo_tree(out, policy, data, eval_every: int) -> dict:
    return {
        "run": {"output_dir": str(out), "seed": 0, "log_every": 1, "eval_every": eval_every},
        "model": {"policy": str(policy)},
        "data": data,
        "generation": {"max_new_tokens": 16, "temperature": 0.7},
        "reward": {"function": POSITIVE_REWARD},
        "eval": {"num_prompts": 6, "batch_size": 4, "gold_function": GOLD},
        "ppo": {
            "iterations": 2,
            "rollout_batch_size": 4,
            "samples_per_prompt": 4,
            "minibatch_size": 16,
            "micro_batch_size": 8,
            "optim": {"lr": 1e-3},
            "kl_coef": 0.05,
            "estimator": "grpo",
        },
    }


def test_grpo_logs_eval_score_and_kl_at_every_iteration_and_trains_the_same(
    sft_run, task_env, runtime, tmp_path, monkeypatch, data_cfg, read_jsonl
):
    data = data_cfg(train=str(task_env.files.prompts), eval=str(task_env.files.eval_prompts))
    policy = sft_run.out / "final"
    chunks = capture_calls(monkeypatch, evaluate, "evaluate_chunk")
    with_eval = tmp_path / "with_eval"
    train_ppo(config_from_dict(grpo_tree(with_eval, policy, data, eval_every=1)), runtime)
    rows = read_jsonl(with_eval / "metrics.jsonl")
    evals = _eval_rows(rows)
    assert sorted(evals) == [1, 2]
    for row in evals.values():
        for name in ("eval/score", "eval/kl_to_ref", "eval/gold_reward", "eval/length"):
            assert math.isfinite(row[name]), (name, row)
        assert 0 <= row["eval/eos_rate"] <= 1 and 0 <= row["eval/gold_reward"] <= 1
        # The reference is the starting policy and the actor has taken a step.
        assert row["eval/kl_to_ref"] != 0
    # eval.num_prompts of the 32 held-out prompts in chunks of eval.batch_size, each time.
    assert [args[2].ids.shape[0] for args, _, _ in chunks] == [4, 2, 4, 2]
    # The same training numbers without the evaluation: it took nothing from the RNG.
    without = tmp_path / "without_eval"
    train_ppo(config_from_dict(grpo_tree(without, policy, data, eval_every=0)), runtime)
    plain = read_jsonl(without / "metrics.jsonl")
    assert not _eval_rows(plain) and len(chunks) == 4
    trained = [r for r in rows if not any(k.startswith("eval/") for k in r)]
    for a, b in zip(trained, plain, strict=True):
        for name in ("objective/score", "objective/kl", "policy/loss", "rollout/length"):
            assert a[name] == b[name], (name, a["step"])


def _stage_tree(stage: str, out, policy, train: str, held_out: str) -> dict:
    section = {"epochs": 1, "batch_size": 16, "micro_batch_size": 8, "optim": {"lr": 1e-3}}
    return {
        "run": {"output_dir": str(out), "seed": 0, "log_every": 1, "eval_every": 1},
        "model": {"policy": str(policy)},
        "data": {"max_prompt_length": 16, "max_length": 48, "train": train, "eval": held_out},
        stage: section,
    }


@pytest.mark.parametrize(
    ("stage", "train_fn", "rows", "names"),
    [
        ("rm", train_reward_model, 32, ("eval/loss", "eval/accuracy", "eval/ece")),
        ("dpo", train_dpo, 32, ("eval/loss", "eval/accuracy", "eval/margins")),
        # a preference row is two KTO examples (chosen desirable, rejected undesirable)
        ("kto", train_kto, 16, ("eval/loss", "eval/kl", "eval/accuracy", "eval/margins")),
    ],
)
def test_preference_stages_log_held_out_figures_at_every_step(
    stage, train_fn, rows, names, sft_run, task_env, runtime, tmp_path, read_jsonl
):
    train, held_out = _split(task_env.files.prefs_train, tmp_path, rows, 12)
    out = tmp_path / stage
    tree = _stage_tree(stage, out, sft_run.out / "final", train, held_out)
    summary = train_fn(config_from_dict(tree), runtime)
    evals = _eval_rows(read_jsonl(out / "metrics.jsonl"))
    assert sorted(evals) == [1, 2]
    for row in evals.values():
        assert all(math.isfinite(row[n]) for n in names), row
    if stage != "rm":  # DPO and KTO: the end-of-run evaluation is the last periodic one
        assert evals[2]["eval/loss"] == summary["eval_loss"]
    assert json.loads((out / "summary.json").read_text())["steps"] == 2


def test_kto_eval_of_a_policy_against_itself_is_exact(sft_run, task_env, runtime, tmp_path):
    from rlhf_dist.data.rows import kto_examples, load_rows
    from rlhf_dist.models import load_causal_lm, tokenizer_for

    cfg = config_from_dict(
        {
            "model": {"policy": str(sft_run.out / "final")},
            "data": {"max_prompt_length": 16, "max_length": 48},
            "kto": {"micro_batch_size": 4, "desirable_weight": 1.0, "undesirable_weight": 2.0},
        }
    )
    tokenizer = tokenizer_for(cfg, "policy")
    rows = load_rows(str(task_env.files.prefs_eval), "data.eval")[:5]
    evals = kto_examples(rows, tokenizer, cfg.data, cfg.kto)[0]
    model = load_causal_lm(cfg.model.policy, "model.policy", "float32", cfg.model)
    numbers = evaluate_kto(runtime, model, model, evals, None, cfg.kto, tokenizer.pad_token_id)
    # r = log pi - log pi_ref = 0 and z0 = 0: each loss is lambda_y (1 - sigmoid(0)).
    desirable = torch.tensor([ex.desirable for ex in evals]).double()
    expected = float((desirable * 1.0 + (1 - desirable) * 2.0).mean() * 0.5)
    assert numbers["kl"] == 0.0 and numbers["margins"] == 0.0
    assert numbers["loss"] == pytest.approx(expected, abs=1e-6)
    assert numbers["accuracy"] == 0.0  # no example is strictly on the right side of z0
