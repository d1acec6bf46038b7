"""Unit tests of rlhf_dist.scoring.RewardFunction: a user's reward function, checked on
every call."""

from pathlib import Path

import pytest
import torch

from rlhf_dist.config import ConfigError, RewardFunctionError
from rlhf_dist.demo.task import positive_word_reward
from rlhf_dist.rewards.scoring import RewardFunction, Scorer

HELPERS = "reward_fns_for_tests"  # tests/unit/reward_fns_for_tests.py


@pytest.fixture
def helpers_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


def test_reward_function_loads_the_demo_reward():
    fn = RewardFunction("rlhf_dist.demo.task:positive_word_reward")
    prompts = ["review of the food :"] * 3
    responses = ["the food was great", "the food was awful", "the food was great and lovely"]
    scores = fn(prompts, responses)
    assert scores.dtype == torch.float32 and scores.shape == (3,)
    assert scores.tolist() == pytest.approx(positive_word_reward(prompts, responses))
    assert scores[0] > 0 > scores[1]  # the expectation is not trivially zero


def test_reward_function_accepts_user_modules(helpers_on_path):
    fn = RewardFunction(f"{HELPERS}:length_reward")
    assert fn(["p", "p"], ["a b c", "a"]).tolist() == [3.0, 1.0]
    assert RewardFunction(f"{HELPERS}:int_reward")(["p"], ["a b"]).tolist() == [2.0]


@pytest.mark.parametrize(
    "spec",
    [
        "no_such_module_for_rlhf_tests:f",
        "rlhf_dist.demo.task:no_such_function",
        "rlhf_dist.demo.task:",
        f"{HELPERS}:NOT_CALLABLE",
    ],
)
def test_reward_function_bad_spec(spec, helpers_on_path):
    with pytest.raises(ConfigError, match=r"^reward\.function: ") as info:
        RewardFunction(spec)
    assert spec in str(info.value) and "\n" not in str(info.value)


def test_reward_function_empty_module_name():
    with pytest.raises(ConfigError, match=r"^reward\.function: "):
        RewardFunction(":positive_word_reward")


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("raises", "KeyError"),
        ("one_short", "returned 1 scores for 2 responses"),
        ("nan_score", "nan"),
        ("inf_score", "inf"),
        ("text_score", "'0.5'"),
    ],
)
def test_reward_function_misbehaving_user_code(name, needle, helpers_on_path):
    fn = RewardFunction(f"{HELPERS}:{name}")
    with pytest.raises(RuntimeError) as info:
        fn(["p", "q"], ["a", "b"])
    message = str(info.value)
    # The user must see which function failed and why.
    assert f"{HELPERS}:{name}" in message and needle in message, message


def test_reward_function_none_means_does_not_apply(helpers_on_path):
    # TRL's rule: None is "this reward does not apply to this row", NaN in the scores
    scores = RewardFunction(f"{HELPERS}:none_score")(["p", "q"], ["a", "b"])
    assert torch.isnan(scores).all()


def test_reward_function_numpy_float32_scores(helpers_on_path):
    fn = RewardFunction(f"{HELPERS}:numpy_float32_scores")
    assert fn(["p", "q"], ["a", "b"]).tolist() == [0.5, 0.5]


class Flaky:
    """A callable object failing (or hanging) on chosen calls, counting every call."""

    def __init__(self, fail=(), hang=(), hang_s=0.0, result=None):
        self.calls, self.fail, self.hang, self.hang_s = 0, set(fail), set(hang), hang_s
        self.result = result

    def __call__(self, prompts, responses):
        self.calls += 1
        if self.calls in self.fail:
            raise ConnectionError(f"down at call {self.calls}")
        if self.calls in self.hang:
            import time

            time.sleep(self.hang_s)
        return self.result if self.result is not None else [1.0] * len(responses)


def test_reward_function_takes_a_callable_and_names_it_by_qualname():
    def closure(prompts, responses):
        return [float(len(r)) for r in responses]

    fn = RewardFunction(closure)
    assert fn(["p"], ["abc"]).tolist() == [3.0]
    assert fn.name.endswith("closure")
    broken = RewardFunction(Flaky(fail={1}))
    with pytest.raises(RewardFunctionError, match=r"reward\.function Flaky raised ConnectionError"):
        broken(["p"], ["a"])


def test_reward_function_retries_an_exception_then_answers():
    flaky = Flaky(fail={1, 2})
    fn = RewardFunction(flaky, retries=2, retry_delay_s=0.0)
    assert fn(["p", "q"], ["a", "b"]).tolist() == [1.0, 1.0]
    assert flaky.calls == 3


def test_reward_function_gives_up_after_its_retries():
    flaky = Flaky(fail={1, 2, 3})
    fn = RewardFunction(flaky, retries=1, retry_delay_s=0.0)
    with pytest.raises(RewardFunctionError, match="after 2 attempts") as info:
        fn(["p"], ["a"])
    assert flaky.calls == 2 and "down at call 2" in str(info.value)


def test_reward_function_timeout_is_a_retried_failure():
    flaky = Flaky(hang={1}, hang_s=5.0)
    fn = RewardFunction(flaky, retries=1, retry_delay_s=0.0, timeout_s=0.2)
    assert fn(["p"], ["a"]).tolist() == [1.0]  # the first call was abandoned, the retry answered
    assert flaky.calls == 2
    stuck = RewardFunction(Flaky(hang={1, 2}, hang_s=5.0), retries=0, timeout_s=0.2)
    with pytest.raises(
        RewardFunctionError, match=r"timed out: no answer within reward\.timeout_s=0\.2 s"
    ):
        stuck(["p"], ["a"])


def test_a_malformed_result_is_not_retried():
    flaky = Flaky(result=[1.0, 2.0])
    fn = RewardFunction(flaky, retries=3, retry_delay_s=0.0)
    with pytest.raises(RewardFunctionError, match="returned 2 scores for 1 responses"):
        fn(["p"], ["a"])
    assert flaky.calls == 1


class OneRank:
    world_size, rank = 1, 0

    def any_rank(self, flag: bool) -> bool:
        return bool(flag)

    def gather_objects(self, items: list) -> list:
        return list(items)


def test_scorer_keeps_a_reward_failure_until_raise_failure():
    flaky = Flaky(fail={2})
    scorer = Scorer(reward_fn=RewardFunction(flaky))
    ids = torch.zeros(2, 3, dtype=torch.long)
    args = (["p", "q"], ["a", "b"], ids, torch.ones_like(ids), torch.tensor([2, 2]))
    assert scorer(*args).tolist() == [1.0, 1.0]
    scorer.raise_failure(OneRank())  # nothing failed: returns
    assert torch.isnan(scorer(*args)).all()  # call 2 failed: kept, NaN scores
    assert torch.isnan(scorer(*args)).all() and flaky.calls == 2  # not called again
    with pytest.raises(RewardFunctionError, match="down at call 2"):
        scorer.raise_failure(OneRank())
    assert scorer.failure is None
