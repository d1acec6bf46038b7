"""TRL's reward interface under 2-rank ZeRO-3 (gloo, issue 49): the seven reward functions
of tests/data/trl_docs_rewards.py, written as TRL's docs write them (completion_ids,
trainer_state, log_metric, an async one, None for rows they do not apply to), under
`rlhf-dist grpo reward.functions=[...]` for 2 iterations, with a tiny reward model's path
in the list too (replicated on every rank), give the 1-rank run's reward metrics. Decoding is greedy (generation.top_k=1), so each response is a function of its
prompt and the weights alone, not of a rank's sampling seed; each rank's rollout is one
scoring pass of the prompts the 1-rank run scores in its matching pass, so the means of
log_metric's per-call values agree too. One launch of each, shared by the asserts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import REPO, one_rank_and_zero3

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
PROMPTS = ["the movie was", "this film is", "a movie about", "i think it"]


@pytest.fixture(scope="module")
def runs(assets, tmp_path_factory) -> dict[str, list[dict]]:
    """metrics.jsonl rows of the 1-rank run and the 2-rank ZeRO-3 run, launched at once."""
    work = tmp_path_factory.mktemp("trl_rewards")
    (work / "trl_docs_rewards.py").write_text(MODULE.read_text())
    (work / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    specs = ",".join([f"trl_docs_rewards:{n}" for n in NAMES] + [assets["reward"]])

    def grpo(out) -> list[str]:
        return [
            "-m", "rlhf_dist", "grpo",
            f"model.policy={assets['policy']}",
            f"data.train={work / 'prompts.jsonl'}",
            f"reward.functions=[{specs}]",
            f"run.output_dir={out}",
            "run.log_every=1",
            "ppo.iterations=2",
            "ppo.rollout_batch_size=4",
            "ppo.samples_per_prompt=2",
            "ppo.rollout_micro_batch_size=4",
            "ppo.minibatch_size=8",
            "ppo.micro_batch_size=2",
            "generation.max_new_tokens=8",
            "generation.top_k=1",
        ]  # fmt: skip

    env = {"PYTHONPATH": f"{REPO}:{work}"}
    return one_rank_and_zero3(grpo, work, env)


def test_two_ranks_give_the_one_rank_runs_reward_metrics(assets, runs):
    one, two = runs["one"], runs["two"]
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2]
    for a, b in zip(one, two):
        keys = [k for k in a if k.startswith(("objective/score", "reward/"))]
        keys += ["objective/raw_score", "rollout/length"]
        rm = Path(assets["reward"]).name
        assert {f"objective/score_{n}" for n in [*NAMES, rm]} <= set(keys)
        for k in keys:
            assert b[k] == pytest.approx(a[k], abs=1e-5, rel=1e-5), k


def test_the_functions_saw_the_run_on_every_rank(runs):
    first, second = runs["two"]
    # two prompts of four are about a movie: async_reward and movie_only apply to half
    assert first["objective/score_async_reward"] == 1.0
    assert first["reward/mean_len"] > 0 and first["reward/skipped_rows"] == 0
    # trainer_state.global_step: the optimizer steps before each rollout (one per iteration)
    assert first["objective/score_step_aware"] == 0.0
    assert second["objective/score_step_aware"] == pytest.approx(0.1)
