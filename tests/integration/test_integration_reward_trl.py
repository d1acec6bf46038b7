"""TRL's reward interface end to end (issue 49): reward functions written exactly as
TRL's docs write them, through `rlhf_dist.grpo(..., reward_fn=...)` for one iteration on
the demo's tiny random policy (seconds on a CPU)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

import rlhf_dist

REPO = Path(__file__).resolve().parents[2]
PROMPTS, SAMPLES, MAX_NEW = 2, 4, 8


def config(task_env, out) -> dict:
    return {
        "model.policy": str(task_env.policy),
        "run.output_dir": str(out),
        "run.log_every": 1,
        "run.samples_every": 1,
        "run.progress": False,
        "perf.num_threads": 1,
        "data.max_prompt_length": 16,
        "data.max_length": 48,
        "generation.max_new_tokens": MAX_NEW,
        "ppo.iterations": 1,
        "ppo.rollout_batch_size": PROMPTS,
        "ppo.samples_per_prompt": SAMPLES,
    }


ROWS = [{"prompt": "the movie was"}, {"prompt": "this film is"}, {"prompt": "i think it"}]


def test_length_in_tokens_reads_the_sampled_completion_ids(task_env, read_jsonl, tmp_path):
    seen: list[tuple[str, list[int]]] = []

    def length_in_tokens(completion_ids, **kwargs):  # TRL's docs, verbatim but the record
        seen.extend(zip(kwargs["completions"], completion_ids))
        return [len(ids) for ids in completion_ids]

    out = tmp_path / "run"
    rlhf_dist.grpo(config(task_env, out), dataset=ROWS, reward_fn=length_in_tokens)
    assert len(seen) == PROMPTS * SAMPLES
    tok = AutoTokenizer.from_pretrained(str(task_env.policy))
    for text, ids in seen:
        assert 1 <= len(ids) <= MAX_NEW and all(isinstance(i, int) for i in ids)
        if len(ids) < MAX_NEW:  # finished early: the stop token is the last sampled id
            assert ids[-1] == tok.eos_token_id
        words = tok.decode(ids, skip_special_tokens=True)
        assert words.replace(" ", "") == text.replace(" ", "")
    (metrics,) = read_jsonl(out / "metrics.jsonl")
    mean = sum(len(ids) for _, ids in seen) / len(seen)
    assert metrics["objective/raw_score"] == pytest.approx(mean)


def test_a_reward_returning_none_skips_and_counts_its_rows(task_env, read_jsonl, tmp_path):
    skipped: list[int] = []

    def movie_only(prompts, completions, **kwargs):  # does not apply to the other prompts
        scores = [len(c) / 10 if "movie" in p else None for p, c in zip(prompts, completions)]
        skipped.append(sum(s is None for s in scores))
        return scores

    out = tmp_path / "run"
    rlhf_dist.grpo(config(task_env, out), dataset=ROWS, reward_fn=movie_only)
    (metrics,) = read_jsonl(out / "metrics.jsonl")
    assert sum(skipped) >= SAMPLES  # 2 of the 3 prompts: one is not about a movie
    assert metrics["reward/skipped_rows"] == sum(skipped)
    assert all(v == v for v in metrics.values() if isinstance(v, float)), "a NaN was logged"


def test_step_aware_and_logs_a_metric(task_env, read_jsonl, tmp_path):
    seen: list[tuple[int, int]] = []

    def step_aware(completions, trainer_state, **kwargs):  # TRL's docs, and a record
        seen.append((trainer_state.global_step, trainer_state.max_steps))
        return [min(1.0, trainer_state.global_step / 10)] * len(completions)

    def logs_a_metric(completions, log_metric, **kwargs):  # TRL's docs
        lengths = [len(c) for c in completions]
        log_metric("mean_len", sum(lengths) / len(lengths))
        return [float(n) / 10 for n in lengths]

    cfg = config(task_env, tmp_path / "run") | {"ppo.iterations": 2}
    rlhf_dist.grpo(cfg, dataset=ROWS, reward_fn=step_aware)
    (max_steps,) = {m for _, m in seen}
    # the optimizer steps done before each iteration's rollout: 0, then one iteration's
    assert max_steps > 0 and sorted({s for s, _ in seen}) == [0, max_steps // 2]
    out = tmp_path / "run2"
    rlhf_dist.grpo(config(task_env, out), dataset=ROWS, reward_fn=logs_a_metric)
    (metrics,) = read_jsonl(out / "metrics.jsonl")
    assert metrics["reward/mean_len"] > 0


def test_a_list_of_rewards_with_weights_logs_each_by_name(task_env, read_jsonl, tmp_path):
    def format_reward(completions, **kwargs):  # TRL's docs style: 1 for a non-empty answer
        return [1.0 if c.strip() else 0.0 for c in completions]

    def reward_len(completions, **kwargs):  # TRL's docs, verbatim
        return [-abs(20 - len(completion)) for completion in completions]

    out = tmp_path / "run"
    rlhf_dist.grpo(
        config(task_env, out),
        dataset=ROWS,
        reward_fn=[format_reward, reward_len],
        reward_weights=[2.0, 0.5],
    )
    (metrics,) = read_jsonl(out / "metrics.jsonl")
    fmt, length = metrics["objective/score_format_reward"], metrics["objective/score_reward_len"]
    assert metrics["objective/raw_score"] == pytest.approx(2.0 * fmt + 0.5 * length)


def test_two_async_rewards_overlap_through_grpo(task_env, read_jsonl, tmp_path):
    spans: dict[str, list[tuple[float, float]]] = {"a": [], "b": []}

    def timed(name: str):
        async def reward(prompts, completions, **kwargs):
            start = time.perf_counter()
            await asyncio.sleep(0.3)
            spans[name].append((start, time.perf_counter()))
            return [float(len(c)) for c in completions]

        reward.__name__ = f"async_{name}"
        return reward

    out = tmp_path / "run"
    rlhf_dist.grpo(config(task_env, out), dataset=ROWS, reward_fn=[timed("a"), timed("b")])
    assert len(spans["a"]) == len(spans["b"]) >= 1
    for (a0, a1), (b0, b1) in zip(spans["a"], spans["b"]):
        assert a0 < b1 and b0 < a1, "the two sleeps did not overlap"
    (metrics,) = read_jsonl(out / "metrics.jsonl")
    assert "objective/score_async_a" in metrics and "objective/score_async_b" in metrics


def test_log_extra_columns_reach_the_samples_table(task_env, read_jsonl, tmp_path):
    import re

    def reward_func(completions, ground_truth, log_extra=None, log_metric=None, **kwargs):
        # TRL's docs, example 6, verbatim
        extracted = [re.search(r"\\boxed\{(.*?)\}", c) for c in completions]
        extracted = [m.group(1) if m else None for m in extracted]
        rewards = [1.0 if e == gt else 0.0 for e, gt in zip(extracted, ground_truth)]

        if log_extra:
            log_extra("golden_answer", list(ground_truth))
            log_extra("extracted_answer", [e or "[none]" for e in extracted])

        if log_metric:
            log_metric("accuracy", sum(rewards) / len(rewards))

        return rewards

    rows = [r | {"ground_truth": f"answer {i}"} for i, r in enumerate(ROWS)]
    out = tmp_path / "run"
    rlhf_dist.grpo(config(task_env, out), dataset=rows, reward_fn=reward_func)
    samples = read_jsonl(out / "samples.jsonl")
    assert samples and len(samples) == min(8, PROMPTS * SAMPLES)
    truth = {r["prompt"]: r["ground_truth"] for r in rows}
    for row in samples:  # each row's own columns, beside its prompt and completion
        assert row["golden_answer"] == truth[row["prompt"]]
        assert row["extracted_answer"] == "[none]" and row["score"] == 0.0
    (metrics,) = read_jsonl(out / "metrics.jsonl")
    assert metrics["reward/accuracy"] == 0.0


def test_a_reward_model_path_in_the_list_scores_with_its_head(task_env, read_jsonl, tmp_path):
    import torch
    import yaml
    from transformers import AutoModelForSequenceClassification

    seen: list[tuple[str, list[int]]] = []

    def recorder(prompts, completion_ids, **kwargs):  # weight 0: only records the rows
        seen.extend(zip(prompts, completion_ids))
        return [0.0] * len(prompts)

    out, rm = tmp_path / "run", str(task_env.reward)
    cfg = config(task_env, out) | {"reward.normalize": False}
    rlhf_dist.grpo(cfg, dataset=ROWS, reward_fn=[recorder, rm], reward_weights=[0.0, 1.0])
    # the head's output read at the last token of prompt + sampled ids (the RM shares the
    # policy's tokenizer, so the text round-trip gives back these very ids)
    tok = AutoTokenizer.from_pretrained(rm)
    head = AutoModelForSequenceClassification.from_pretrained(rm).eval()
    with torch.no_grad():
        expected = [
            float(head(torch.tensor([tok(p)["input_ids"] + ids])).logits[0, 0]) for p, ids in seen
        ]
    (metrics,) = read_jsonl(out / "metrics.jsonl")
    name = Path(rm).name
    assert len(expected) == PROMPTS * SAMPLES
    assert metrics[f"objective/score_{name}"] == pytest.approx(
        sum(expected) / len(expected), abs=1e-5
    )
    assert metrics["objective/raw_score"] == pytest.approx(metrics[f"objective/score_{name}"])
    saved = yaml.safe_load((out / "config.yaml").read_text())["reward"]["functions"]
    assert saved == ["python:recorder", rm]  # each item by its name, the model by its path


def movie_only(prompts, completions, log_extra=None, **kwargs):
    """Applies to the prompts about a movie only (None elsewhere), logging a column."""
    if log_extra:
        log_extra("about", ["movie" if "movie" in p else "other" for p in prompts])
    return [len(c) / 10 if "movie" in p else None for p, c in zip(prompts, completions)]


def test_eval_leaves_rows_no_reward_applies_to_out_and_counts_them(task_env, read_jsonl, tmp_path):
    out = tmp_path / "eval"
    cfg = config(task_env, out) | {"eval.num_prompts": 3, "eval.batch_size": 2}
    summary = rlhf_dist.eval(cfg, dataset=ROWS, reward_fn=[movie_only])
    samples = read_jsonl(out / "samples.jsonl")
    assert len(samples) == 3 and summary["skipped_rows"] == 2  # the two other prompts
    scored = [s for s in samples if s["prompt"] == "the movie was"]
    assert [s["about"] for s in samples if s["score"] is None] == ["other", "other"]
    assert summary["score"] == pytest.approx(scored[0]["score"])  # the mean of scored rows


def test_online_dpo_skips_rows_no_reward_applies_to(task_env, read_jsonl, tmp_path):
    out = tmp_path / "run"
    rlhf_dist.online_dpo(config(task_env, out), dataset=ROWS, reward_fn=[movie_only])
    (metrics,) = read_jsonl(out / "metrics.jsonl")
    assert metrics["reward/skipped_rows"] >= SAMPLES  # at least one group of another prompt
    assert all(v == v for v in metrics.values() if isinstance(v, float)), "a NaN was logged"
    # a group no reward applied to ties (its rows all take the fill 0) and forms no pair
    movie_groups = PROMPTS - metrics["reward/skipped_rows"] / SAMPLES
    assert metrics["online_dpo/pairs"] <= movie_groups


# The seven functions of the issue as a TRL user's module beside the data
# (tests/data/trl_docs_rewards.py), named on the command line.
MODULE = REPO / "tests" / "data" / "trl_docs_rewards.py"
NAMES = [
    "reward_len",
    "format_reward",
    "movie_only",
    "length_in_tokens",
    "step_aware",
    "logs_a_metric",
    "async_reward",
]


def test_the_trl_functions_through_the_command_line(task_env, read_jsonl, tmp_path):
    import yaml

    work = tmp_path / "work"
    work.mkdir()
    (work / "my_rewards.py").write_text(MODULE.read_text())
    (work / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    specs = [f"my_rewards:{n}" for n in NAMES]
    sizes = [f"{k}={v}" for k, v in config(task_env, tmp_path / "run").items()]
    proc = run_cli(
        work, "grpo", "data.train=prompts.jsonl", f"reward.functions=[{','.join(specs)}]", *sizes
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (metrics,) = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert metrics["reward/mean_len"] > 0 and metrics["reward/skipped_rows"] == 0
    assert all(f"objective/score_{n}" in metrics for n in NAMES)
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["reward"]
    assert saved["functions"] == specs


def run_cli(work: Path, *args: str) -> subprocess.CompletedProcess:
    """`rlhf-dist ARGS` in `work` (the installed console script beside this interpreter,
    else on PATH), with this checkout on PYTHONPATH."""
    beside = Path(sys.executable).parent / "rlhf-dist"
    script = str(beside) if beside.is_file() else shutil.which("rlhf-dist") or "rlhf-dist"
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env = base | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [script, *args], cwd=work, env=env, capture_output=True, text=True, timeout=240
    )
