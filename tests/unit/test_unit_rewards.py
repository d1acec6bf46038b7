"""Several rewards, the remote reward client and the judge (docs/rewards.md): combination,
names, parsing, config checks, and HTTP against a local stub server (tests/http_stub.py)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from http_stub import StubServer, chat_reply

from rlhf_dist.config import ConfigError, RewardFunctionError, load_config, validate
from rlhf_dist.data.chat import prompt_text
from rlhf_dist.evaluate import win_share
from rlhf_dist.rewards.judge import JudgeReward, parse_score
from rlhf_dist.rewards.remote import ChatJudgeClient, RemoteReward
from rlhf_dist.rewards.scoring import RewardFunction, Scorer, WeightedReward, unique_names

HELPERS = "reward_fns_for_tests"
KEY = "sk-test-4f1d9c0e-never-write-me"


def words(prompts, responses):
    return [float(len(r.split())) for r in responses]


def chars(prompts, responses):
    return [float(len(r)) for r in responses]


class OneRank:
    """What StatSums.reduce needs of a runtime, for one process."""

    world_size, device = 1, torch.device("cpu")

    def all_sum(self, x):
        return x

    def all_max(self, x):
        return x

    def gather_objects(self, items):
        return list(items)


def reward_cfg(*overrides):
    return load_config(None, ["model.policy=p", "data.train=t", *overrides])


def test_weighted_reward_hand_computed():
    fn = WeightedReward(
        [("words", 2.0, RewardFunction(words)), ("chars", -0.5, RewardFunction(chars))]
    )
    out = fn(["p", "p"], ["a bb", "ccc"])
    # 2 x [2, 1] - 0.5 x [4, 3] = [2, 0.5]
    assert out.tolist() == [2.0, 0.5]
    assert fn.take_sums() == {"words": (3.0, 2), "chars": (7.0, 2)}
    assert fn.take_sums() == {"words": (0.0, 0), "chars": (0.0, 0)}


def test_weighted_reward_is_linear_in_weights():
    rng = random.Random(0)
    responses = [
        " ".join("x" * rng.randint(1, 4) for _ in range(rng.randint(1, 6))) for _ in range(9)
    ]
    for _ in range(5):
        w = [rng.uniform(-2, 2), rng.uniform(-2, 2)]
        fn = WeightedReward(
            [("a", w[0], RewardFunction(words)), ("b", w[1], RewardFunction(chars))]
        )
        got = fn(["p"] * 9, responses)
        want = w[0] * torch.tensor(words(None, responses)) + w[1] * torch.tensor(
            chars(None, responses)
        )
        assert torch.allclose(got, want)


def test_component_stats_logged_per_name_and_cleared():
    scorer = Scorer(reward_fn=WeightedReward([("words", 1.0, RewardFunction(words))]))
    scorer._function_scores(["p"] * 2, ["a b c", "d"])
    skipped = {"reward/skipped_rows": 0.0}  # rows no function applied to (None)
    assert scorer.component_stats(OneRank()) == {"objective/score_words": 2.0} | skipped
    assert Scorer(reward_fn=RewardFunction(words)).component_stats(OneRank()) == skipped


def test_one_failing_component_fails_the_call_and_scorer_keeps_it():
    def broken(prompts, responses):
        raise ConnectionError("down")

    fn = WeightedReward(
        [("words", 1.0, RewardFunction(words)), ("broken", 1.0, RewardFunction(broken))]
    )
    scorer = Scorer(reward_fn=fn)
    assert torch.isnan(scorer._function_scores(["p"], ["a"])).all()
    assert "broken" in str(scorer.failure) and "down" in str(scorer.failure)


def test_unique_names():
    assert unique_names(["f", "f", "g", "f"]) == ["f", "f_2", "g", "f_3"]
    assert unique_names(["f", "f_2", "f"]) == ["f", "f_2", "f_3"]
    assert len(set(unique_names(["a"] * 7))) == 7


@pytest.mark.parametrize(
    "reply, score",
    [("7", 7.0), ("Score: 8/10", 8.0), (" -2.5 points", -2.5), ("ten", None), ("", None)],
)
def test_parse_score(reply, score):
    assert parse_score(reply) == score


class Scripted:
    def __init__(self, replies):
        self.replies_given, self.seen = list(replies), []

    def replies(self, texts):
        self.seen += texts
        return [self.replies_given.pop(0) for _ in texts]


def test_judge_reward_renders_template_and_counts_parse_failures():
    judge = Scripted(["Score: 9", "no idea", "3"])
    fn = JudgeReward(judge, "Q={prompt} A={response}", fallback=0.0)
    prompts = ["hi", [{"role": "user", "content": "yo"}], "x"]
    assert fn(prompts, ["a", "b", "c"]) == [9.0, 0.0, 3.0]
    assert judge.seen == ["Q=hi A=a", "Q=user: yo A=b", "Q=x A=c"]
    assert fn.take_counts() == 1 and fn.take_counts() == 0
    assert prompt_text("plain") == "plain"


def test_judge_without_fallback_fails_on_a_reply_without_number():
    fn = JudgeReward(Scripted(["nothing"]), "{prompt}{response}", fallback=None)
    with pytest.raises(RewardFunctionError, match="reward.judge"):
        fn(["p"], ["r"])


def test_win_share_ties_count_half():
    out = win_share(torch.tensor([3.0, 5.0, 2.0]), torch.tensor([1.0, 5.0, 4.0]))
    assert out.tolist() == [1.0, 0.5, 0.0]


@pytest.mark.parametrize(
    "overrides, named",
    [
        (
            [
                f"reward.function={HELPERS}:length_reward",
                f"reward.functions=[{HELPERS}:length_reward]",
            ],
            "reward.functions",
        ),
        (
            [f"reward.functions=[{HELPERS}:length_reward]", "reward.weights=[1, 2]"],
            "reward.weights",
        ),
        (["reward.judge=model"], "reward.judge_model"),
        (["reward.judge=url", "reward.judge_url=http://x"], "reward.judge_model_name"),
        (["reward.url=ftp://x"], "reward.url"),
        (["reward.url=http://x", "reward.remote_batch_size=0"], "reward.remote_batch_size"),
        (["reward.url=http://x", "reward.api_key_env=sk-abc def"], "reward.api_key_env"),
        (
            ["reward.judge=model", "reward.judge_model=m", "reward.judge_template=Rate it"],
            "reward.judge_template",
        ),
        (["reward.judge=sometimes"], "reward.judge"),
    ],
)
def test_reward_keys_are_checked(overrides, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        validate(reward_cfg(*overrides), "ppo")


def test_reward_weights_parse_as_floats_and_sources_replace_the_model():
    cfg = reward_cfg(
        f"reward.functions=[{HELPERS}:length_reward, {HELPERS}:int_reward]",
        "reward.weights=[1, 0.5]",
    )
    validate(cfg, "ppo")  # no model.reward needed
    assert cfg.reward.weights == (1.0, 0.5) and cfg.reward.text_rewards()


# ------------------------------------------------------------------------- HTTP (stub)


def http_cfg(url: str, *extra):
    return reward_cfg(f"reward.url={url}", "reward.retry_delay_s=0", *extra).reward


def test_remote_reward_batches_and_sends_the_key(monkeypatch):
    monkeypatch.setenv("TEST_REWARD_KEY", KEY)

    def answer(path, body, headers):
        return 200, {"scores": [float(len(r)) for r in body["responses"]]}

    with StubServer(answer, max_requests=3) as stub:
        cfg = http_cfg(
            stub.url + "/score", "reward.remote_batch_size=2", "reward.api_key_env=TEST_REWARD_KEY"
        )
        fn = RewardFunction(RemoteReward(cfg), key="reward.url")
        prompts = ["p1", [{"role": "user", "content": "m"}], "p3", "p4", "p5"]
        out = fn(prompts, ["a", "bb", "ccc", "dddd", "e"])
    assert out.tolist() == [1.0, 2.0, 3.0, 4.0, 1.0]
    assert [len(b["responses"]) for _, b, _ in stub.requests] == [2, 2, 1]
    assert stub.requests[0][1]["prompts"][1] == [{"role": "user", "content": "m"}]
    assert all(h.get("Authorization") == f"Bearer {KEY}" for _, _, h in stub.requests)


def test_remote_reward_retries_a_server_failing_twice(capsys):
    def answer(path, body, headers):
        if len(stub.requests) <= 2:
            return 503, {"error": "busy"}
        return 200, {"scores": [1.5] * len(body["responses"])}

    with StubServer(answer, max_requests=3) as stub:
        fn = RemoteReward(http_cfg(stub.url, "reward.retries=2"))
        assert fn(["p"], ["r"]) == [1.5]
    assert len(stub.requests) == 3
    assert capsys.readouterr().err.count("retrying") == 2


def test_remote_failure_message_never_holds_the_key(monkeypatch, capsys):
    monkeypatch.setenv("TEST_REWARD_KEY", KEY)

    def answer(path, body, headers):  # a server that echoes what it got, key included
        return 500, {"error": f"bad request with {headers.get('Authorization')}"}

    with StubServer(answer, max_requests=2) as stub:
        fn = RewardFunction(
            RemoteReward(
                http_cfg(stub.url, "reward.retries=1", "reward.api_key_env=TEST_REWARD_KEY")
            ),
            key="reward.url",
        )
        with pytest.raises(RewardFunctionError) as caught:
            fn(["p"], ["r"])
    message = str(caught.value) + repr(caught.value.__cause__) + capsys.readouterr().err
    assert "HTTP 500" in message and "***" in message
    assert KEY not in message


def test_missing_key_variable_is_a_config_error(monkeypatch):
    monkeypatch.delenv("TEST_REWARD_KEY", raising=False)
    with pytest.raises(ConfigError, match="reward.api_key_env.*TEST_REWARD_KEY"):
        RemoteReward(http_cfg("http://127.0.0.1:9", "reward.api_key_env=TEST_REWARD_KEY"))


def test_chat_judge_client_speaks_chat_completions():
    def answer(path, body, headers):
        assert path == "/v1/chat/completions" and body["model"] == "judge-1"
        assert body["temperature"] == 0.0 and body["max_tokens"] == 8
        return 200, chat_reply(f"Score: {len(body['messages'][0]['content'])}")

    with StubServer(answer, max_requests=3) as stub:
        cfg = reward_cfg(
            "reward.judge=url",
            f"reward.judge_url={stub.url}/v1/",
            "reward.judge_model_name=judge-1",
        ).reward
        fn = JudgeReward(ChatJudgeClient(cfg), "{prompt}|{response}", 0.0)
        assert fn(["ab", "c", "d"], ["x", "yy", ""]) == [4.0, 4.0, 2.0]
    assert len(stub.requests) == 3 and not math.isnan(fn.take_counts())
