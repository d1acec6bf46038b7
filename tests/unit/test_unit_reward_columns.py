"""Reward functions, judges, remote rewards and environments read each row's other
columns (an `answer`, a `solution`) beside the prompt, as TRL hands them over
(docs/rewards.md): `fn(prompts, completions, **columns)` in TRL's convention,
`fn(prompts, responses, **columns)` in ours, and the two-argument form as before."""

from __future__ import annotations

import pytest
import torch
from http_stub import StubServer

from rlhf_dist.config import ConfigError, RewardConfig, RewardFunctionError
from rlhf_dist.data.inputs import accepted_columns, column_lists, required_parameters
from rlhf_dist.rewards.judge import JudgeReward
from rlhf_dist.rewards.remote import RemoteReward
from rlhf_dist.rewards.scoring import RewardFunction, Scorer, WeightedReward, check_reward_columns
from rlhf_dist.rollout.agent import Agent, ToolEnvironment, start_episode

PROMPTS = ["What is 3 + 4?", [{"role": "user", "content": "What is 2 + 2?"}]]
RESPONSES = ["7", "5"]
ROWS = [{"answer": "7", "level": 1}, {"answer": "4", "level": 2}]


def trl_accuracy(prompts, completions, answer, **kwargs):
    """TRL's idiom: a conversational completion is [{"role": "assistant", "content": ...}]."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [float(t == a) for t, a in zip(texts, answer)]


def ours_accuracy(prompts, responses, answer):
    return [float(r == a) for r, a in zip(responses, answer)]


def two_arguments(prompts, responses):
    return [float(len(r)) for r in responses]


def test_column_lists_are_one_list_per_column_with_none_where_a_row_lacks_it():
    rows = [{"a": 1, "b": 2}, {"a": 3}]
    assert column_lists(rows) == {"a": [1, 3], "b": [2, None]}
    assert column_lists([]) == {}


def test_functions_get_the_columns_they_name_or_all_with_kwargs():
    def named(prompts, responses, answer): ...

    def anything(prompts, completions, **kw): ...

    columns = {"answer": [1], "level": [2]}
    assert accepted_columns(named, columns, ("prompts", "responses")) == {"answer": [1]}
    assert accepted_columns(anything, columns, ("prompts", "completions")) == columns
    assert accepted_columns(print, columns) == {}  # no signature to read: none
    assert required_parameters(named, skip=2) == ["answer"]
    assert required_parameters(anything) == ["prompts", "completions"]


def test_trl_convention_gets_completions_as_trl_gives_them_and_the_answer():
    seen = []

    def spy(prompts, completions, answer, **kwargs):
        seen.append((completions, answer, kwargs))
        return trl_accuracy(prompts, completions, answer)

    scores = RewardFunction(spy)(PROMPTS, RESPONSES, ROWS)
    assert scores.tolist() == [1.0, 0.0]
    ((completions, answer, kwargs),) = seen
    # a text prompt: the text; a conversational one: one assistant message
    assert completions == ["7", [{"role": "assistant", "content": "5"}]]
    assert answer == ["7", "4"] and kwargs == {"level": [1, 2]}


def test_our_convention_takes_named_columns_and_the_two_argument_form_is_unchanged():
    assert RewardFunction(ours_accuracy)(PROMPTS, RESPONSES, ROWS).tolist() == [1.0, 0.0]
    assert RewardFunction(two_arguments)(PROMPTS, RESPONSES, ROWS).tolist() == [1.0, 1.0]
    assert RewardFunction(two_arguments)(PROMPTS, RESPONSES).tolist() == [1.0, 1.0]


def test_a_required_column_the_rows_lack_is_one_clear_error():
    fn = RewardFunction(ours_accuracy)
    with pytest.raises(RewardFunctionError, match=r"needs the column\(s\) answer.*have: level"):
        fn(PROMPTS, RESPONSES, [{"level": 1}, {"level": 2}])
    assert fn.missing_columns({"answer"}) == []
    assert RewardFunction(trl_accuracy).missing_columns({"solution"}) == ["answer"]


def test_a_run_checks_the_columns_before_any_model_loads(monkeypatch):
    import sys
    import types

    module = types.ModuleType("columns_for_tests")
    module.accuracy = ours_accuracy
    monkeypatch.setitem(sys.modules, "columns_for_tests", module)
    cfg = RewardConfig(function="columns_for_tests:accuracy")
    check_reward_columns(cfg, {"answer", "level"}, "data.train 'x.jsonl'")
    with pytest.raises(
        ConfigError,
        match=r"^reward.function: .*accuracy needs the column\(s\) "
        r"answer, which data.train 'x.jsonl' does not have \(it has: level\)",
    ):
        check_reward_columns(cfg, {"level"}, "data.train 'x.jsonl'")


def test_several_rewards_and_the_scorer_pass_the_columns_on():
    weighted = WeightedReward(
        [("acc", 2.0, RewardFunction(trl_accuracy)), ("len", 1.0, RewardFunction(two_arguments))]
    )
    scorer = Scorer(reward_fn=weighted)
    ids = torch.zeros(2, 3, dtype=torch.long)
    scores = scorer(PROMPTS, RESPONSES, ids, torch.ones_like(ids), torch.tensor([2, 2]), ROWS)
    assert scores.tolist() == [3.0, 1.0]
    assert scorer.missing_columns({"level"}) == ["answer"]


def test_the_judge_template_fills_in_the_rows_columns():
    class Echo:
        seen: list = []

        def replies(self, texts):
            self.seen += texts
            return ["8"] * len(texts)

    judge = Echo()
    fn = JudgeReward(judge, "Q: {prompt}\nA: {response}\nReference: {answer} {missing}", 0.0)
    assert RewardFunction(fn, key="reward.judge")(PROMPTS, RESPONSES, ROWS).tolist() == [8.0] * 2
    assert judge.seen[0] == "Q: What is 3 + 4?\nA: 7\nReference: 7 {missing}"
    assert judge.seen[1] == "Q: user: What is 2 + 2?\nA: 5\nReference: 4 {missing}"


def test_a_remote_reward_receives_the_columns():
    def answer(path, body, headers):
        return 200, {
            "scores": [float(r == a) for r, a in zip(body["responses"], body["columns"]["answer"])]
        }

    with StubServer(answer, max_requests=2) as server:
        cfg = RewardConfig(url=server.url, remote_batch_size=8, retries=0)
        fn = RewardFunction(RemoteReward(cfg), key="reward.url", retries=0)
        assert fn(PROMPTS, RESPONSES, ROWS).tolist() == [1.0, 0.0]
    ((_, body, _),) = server.requests
    assert body["columns"] == {"answer": ["7", "4"], "level": [1, 2]}


def test_an_environment_is_reset_with_the_columns_it_names():
    class Checked(ToolEnvironment):
        def reset(self, prompt, answer):
            self.answer = answer
            return super().reset(prompt)

    envs = []

    def factory():
        envs.append(Checked({}, 1.0))
        return envs[-1]

    class Renderer:
        def prompt_ids(self, messages):
            return [1, 2]

    agent = Agent(factory, Renderer(), 2, 16)
    start_episode(agent, "What is 3 + 4?", {"answer": "7", "level": 1})
    assert envs[0].answer == "7"
    with pytest.raises(TypeError, match="answer"):  # a reset that needs a column the row lacks
        start_episode(agent, "p", {"level": 1})
