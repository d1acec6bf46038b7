"""Unit tests of rlhf_dist.scoring.RewardFunction: a user's reward function, checked on
every call."""

from pathlib import Path

import pytest
import torch

from rlhf_dist.config import ConfigError
from rlhf_dist.demo.task import positive_word_reward
from rlhf_dist.scoring import RewardFunction

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
        ("none_score", "None"),
    ],
)
def test_reward_function_misbehaving_user_code(name, needle, helpers_on_path):
    fn = RewardFunction(f"{HELPERS}:{name}")
    with pytest.raises(RuntimeError) as info:
        fn(["p", "q"], ["a", "b"])
    message = str(info.value)
    # The user must see which function failed and why.
    assert f"{HELPERS}:{name}" in message and needle in message, message


def test_reward_function_numpy_float32_scores(helpers_on_path):
    fn = RewardFunction(f"{HELPERS}:numpy_float32_scores")
    assert fn(["p", "q"], ["a", "b"]).tolist() == [0.5, 0.5]
