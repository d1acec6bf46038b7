"""TRL's reward interface (issue 49, docs/rewards.md): reward functions written exactly as
TRL's docs write them are called by TRL's rule, by keyword, with `completion_ids`; a
signature mismatch is one line at once naming the function and the missing parameter."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import torch

from rlhf_dist.config import RewardFunctionError
from rlhf_dist.data.inputs import registered
from rlhf_dist.rewards.scoring import (
    SAMPLE_COLUMNS,
    RewardFunction,
    Scorer,
    WeightedReward,
    trl_convention,
)

PROMPTS = ["Say hi", [{"role": "user", "content": "Say bye"}]]
RESPONSES = ["hi there", "bye"]
IDS = [[5, 6, 2], [7, 2]]  # each up to and including its stop token


def reward_len(completions, **kwargs):  # TRL's docs, verbatim
    return [-abs(20 - len(completion)) for completion in completions]


def length_in_tokens(completion_ids, **kwargs):  # TRL's docs, verbatim
    return [len(ids) for ids in completion_ids]


def only_kwargs(**kwargs):
    return [float(len(kwargs["completion_ids"][i])) for i in range(len(kwargs["prompts"]))]


def ours(prompts, responses):
    return [float(len(r)) for r in responses]


def test_trl_rule_tells_the_conventions_apart():
    def keyword_only(*, prompts, answer):
        return []

    def positional_only(prompts, completions, /):
        return []

    def star_args(*args, **kwargs):
        return []

    assert trl_convention(reward_len) and trl_convention(length_in_tokens)
    assert trl_convention(only_kwargs) and trl_convention(keyword_only)
    assert not trl_convention(ours) and not trl_convention(positional_only)
    assert not trl_convention(star_args) and not trl_convention(len)


def test_length_in_tokens_gets_the_completion_ids_by_keyword():
    fn = RewardFunction(length_in_tokens, retries=3, retry_delay_s=0.0)
    assert fn(PROMPTS, RESPONSES, None, IDS).tolist() == [3.0, 2.0]
    assert RewardFunction(only_kwargs)(PROMPTS, RESPONSES, None, IDS).tolist() == [3.0, 2.0]


def test_reward_len_and_ours_still_score_as_before():
    assert RewardFunction(reward_len)(PROMPTS, RESPONSES, None, IDS).tolist() == [-12.0, -19.0]
    assert RewardFunction(ours)(PROMPTS, RESPONSES, None, IDS).tolist() == [8.0, 3.0]


def test_a_signature_mismatch_is_one_line_at_once_naming_function_and_parameter():
    calls = []

    def wants_ref(completions, reference):
        calls.append(1)
        return [0.0] * len(completions)

    fn = RewardFunction(wants_ref, retries=3, retry_delay_s=10.0)
    with pytest.raises(RewardFunctionError) as e:
        fn(PROMPTS, RESPONSES, None, IDS)
    assert "wants_ref" in str(e.value) and "reference" in str(e.value)
    assert "\n" not in str(e.value) and not calls  # never called, never retried


def test_completion_ids_nobody_provides_names_them():
    with pytest.raises(RewardFunctionError, match="length_in_tokens wants the argument "):
        RewardFunction(length_in_tokens)(PROMPTS, RESPONSES)


def test_a_python_spec_is_named_by_its_function_not_its_key():
    with registered({"reward.function": length_in_tokens}) as specs:
        fn = RewardFunction(specs["reward.function"])
    assert fn.name == "length_in_tokens"
    with pytest.raises(RewardFunctionError) as e:
        fn(PROMPTS, RESPONSES)
    assert "python:" not in str(e.value) and "length_in_tokens" in str(e.value)


def test_the_scorer_and_a_weighted_reward_pass_the_ids_on():
    parts = [("a", 1.0, RewardFunction(length_in_tokens)), ("b", 0.5, RewardFunction(ours))]
    scorer = Scorer(reward_fn=WeightedReward(parts))
    ids = torch.zeros(2, 4, dtype=torch.long)
    out = scorer(PROMPTS, RESPONSES, ids, ids, torch.tensor([3, 3]), [{}, {}], IDS)
    assert out.tolist() == [3.0 + 4.0, 2.0 + 1.5] and scorer.failure is None


def only_short(completions, **kwargs):  # TRL's "does not apply": None for long ones
    return [1.0 if len(c) < 5 else None for c in completions]


def never(completions, **kwargs):
    return [None] * len(completions)


class OneRank:
    world_size, device = 1, torch.device("cpu")

    def all_sum(self, t):
        return t

    def gather_objects(self, items):
        return list(items)


def test_none_leaves_a_function_out_of_the_rows_weighted_sum():
    parts = [("short", 2.0, RewardFunction(only_short)), ("len", 0.5, RewardFunction(ours))]
    out = WeightedReward(parts)(PROMPTS, RESPONSES, None, IDS)
    # "hi there" (8 chars): only `len` applies; "bye": both
    assert out.tolist() == [0.5 * 8, 2.0 * 1 + 0.5 * 3]


def test_a_row_no_function_applies_to_is_a_counted_skip():
    parts = [("short", 1.0, RewardFunction(only_short)), ("never", 1.0, RewardFunction(never))]
    scorer = Scorer(reward_fn=WeightedReward(parts))
    ids = torch.zeros(2, 4, dtype=torch.long)
    out = scorer(PROMPTS, RESPONSES, ids, ids, torch.tensor([3, 3]), [{}, {}], IDS)
    assert torch.isnan(out[0]) and out[1] == 1.0 and scorer.failure is None
    stats = scorer.component_stats(OneRank())
    assert stats["reward/skipped_rows"] == 1.0
    assert stats["objective/score_short"] == 1.0  # its mean over the rows it applied to
    assert scorer.component_stats(OneRank())["reward/skipped_rows"] == 0.0  # reset


def test_a_skipped_row_leaves_the_loss_and_takes_its_groups_mean():
    from rlhf_dist.rollout.batch import RolloutBatch
    from rlhf_dist.trainers.ppo.rollout import without_unscored_rows

    B, T = 4, 3
    nan = float("nan")
    fields = {f.name: None for f in dataclasses.fields(RolloutBatch)}
    fields |= {
        "prompt_ids": torch.zeros(B, 2, dtype=torch.long),
        "prompt_mask": torch.ones(B, 2, dtype=torch.long),
        "response_ids": torch.ones(B, T, dtype=torch.long),
        "response_mask": torch.ones(B, T, dtype=torch.bool),
        "finished": torch.ones(B, dtype=torch.bool),
        "scores": torch.tensor([1.0, nan, 3.0, nan]),
        "raw_scores": torch.tensor([1.0, nan, 3.0, nan]),
    }
    batch = without_unscored_rows(RolloutBatch(**fields), group_size=2)
    assert batch.scores.tolist() == [1.0, 1.0, 3.0, 3.0]
    assert batch.raw_scores.tolist() == [1.0, 1.0, 3.0, 3.0]
    assert batch.response_mask.sum(1).tolist() == [T, 0, T, 0]


def step_aware(completions, trainer_state, **kwargs):  # TRL's docs: a curriculum
    return [float(trainer_state.global_step)] * len(completions)


def logs_a_metric(completions, log_metric, **kwargs):  # TRL's docs
    lengths = [len(c) for c in completions]
    log_metric("mean_len", sum(lengths) / len(lengths))
    return [float(n) for n in lengths]


def test_trainer_state_and_log_metric_reach_the_function_and_the_metrics():
    from rlhf_dist.rewards.scoring import RewardTrainerState

    parts = [("s", 1.0, RewardFunction(step_aware)), ("m", 1.0, RewardFunction(logs_a_metric))]
    scorer = Scorer(reward_fn=WeightedReward(parts))
    scorer.trainer_state = RewardTrainerState(global_step=6, epoch=0.5, max_steps=12)
    out = scorer.score_texts(["p", "q"], RESPONSES)  # text prompts: text completions
    assert out.tolist() == [6.0 + 8, 6.0 + 3] and scorer.failure is None
    stats = scorer.component_stats(OneRank())
    assert stats["reward/mean_len"] == 5.5
    assert "reward/mean_len" not in scorer.component_stats(OneRank())  # cleared


def test_trainer_state_and_log_metric_are_named_no_column():
    for fn in (step_aware, logs_a_metric):
        assert RewardFunction(fn).missing_columns([]) == []


def test_a_list_of_rewards_is_registered_item_by_item_and_rows_stay_one_object():
    from rlhf_dist.api import reward_objects
    from rlhf_dist.data.inputs import resolve_callable

    rows = [{"prompt": "a"}]
    objects = reward_objects([reward_len, length_in_tokens]) | {"data.train": rows}
    with registered(objects) as specs:
        assert specs["data.train"] == "python:data.train"
        first, second = specs["reward.functions"]
        assert (first, second) == ("python:reward_len", "python:length_in_tokens")
        assert resolve_callable(first, "reward.functions") is reward_len
        assert RewardFunction(second, key="reward.functions").name == "length_in_tokens"
    assert reward_objects(reward_len) == {"reward.function": reward_len}


async def async_reward(prompts, completions, **kwargs):  # TRL's docs, with a sleep
    await asyncio.sleep(0.5)
    return [float(len(c)) for c in completions]


async def other_async_reward(prompts, completions, **kwargs):
    await asyncio.sleep(0.5)
    return [1.0] * len(completions)


def test_an_async_reward_is_awaited():
    assert RewardFunction(async_reward)(["p", "q"], RESPONSES).tolist() == [8.0, 3.0]


def test_two_async_rewards_run_concurrently():
    parts = [
        ("a", 1.0, RewardFunction(async_reward)),
        ("b", 1.0, RewardFunction(other_async_reward)),
        ("c", 1.0, RewardFunction(ours)),
    ]
    start = time.perf_counter()
    out = WeightedReward(parts)(["p", "q"], RESPONSES)
    assert time.perf_counter() - start < 0.9  # the two 0.5 s sleeps overlapped
    assert out.tolist() == [8.0 + 1 + 8, 3.0 + 1 + 3]


def test_an_async_reward_has_the_retry_rules():
    calls = []

    async def flaky(completions, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("transient")
        return [0.5] * len(completions)

    fn = RewardFunction(flaky, retries=1, retry_delay_s=0.0, timeout_s=5.0)
    assert fn(["p", "q"], RESPONSES).tolist() == [0.5, 0.5] and len(calls) == 2


def test_an_async_reward_inside_a_running_event_loop():
    async def main():
        return RewardFunction(async_reward)(["p", "q"], RESPONSES).tolist()

    assert asyncio.run(main()) == [8.0, 3.0]


def logs_extra(completions, log_extra=None, **kwargs):  # TRL's docs, example 6's pattern
    if log_extra:
        log_extra("chars", [len(c) for c in completions])
    return [1.0] * len(completions)


def test_log_extra_columns_go_to_each_rows_sample():
    parts = [("x", 1.0, RewardFunction(logs_extra)), ("len", 1.0, RewardFunction(ours))]
    scorer = Scorer(reward_fn=WeightedReward(parts))
    scorer.score_texts(["p", "q"], RESPONSES)
    scorer.score_texts(["p"], ["hello"])  # the same prompt again, another response
    # rows asked for in another order than scored, one row never scored
    extra = scorer.take_extra_columns(["p", "q", "p", "r"], ["hello", "bye", "hi there", "x"])
    assert extra == [{"chars": 5}, {"chars": 3}, {"chars": 8}, {"chars": None}]
    assert scorer.take_extra_columns(["p"], ["hello"]) == [{}]  # forgotten once taken
    assert Scorer().take_extra_columns(["p", "q"], RESPONSES) == [{}, {}]  # none logged
    # a multi-turn episode is scored with its conversation: found by its response
    scorer.score_texts(
        [[{"role": "user", "content": "p"}, {"role": "tool", "content": "t"}]], ["ok"]
    )
    assert scorer.take_extra_columns(["p"], ["ok"]) == [{"chars": 1}]  # one message


def test_log_extra_with_a_value_per_row_missing_is_one_line_naming_the_column():
    def short(completions, log_extra, **kwargs):
        log_extra("answer", ["only one"])
        return [1.0] * len(completions)

    def clashes(completions, log_extra, **kwargs):
        log_extra("score", [0] * len(completions))
        return [1.0] * len(completions)

    for fn in (short, clashes):
        scorer = Scorer(reward_fn=RewardFunction(fn))
        assert torch.isnan(scorer.score_texts(["p", "q"], RESPONSES)).all()
        message = str(scorer.failure)
        assert "log_extra(" in message and "\n" not in message
    assert RewardFunction(short).missing_columns([]) == []


def test_list_items_are_named_by_function_and_a_string_stays_as_given():
    from rlhf_dist.data.inputs import is_model_name, list_specs
    from rlhf_dist.rewards.tasks import answer_format

    def reward_len(completions, **kwargs):  # a second function of the same name
        return [0.0] * len(completions)

    items = [globals()["reward_len"], reward_len, "org/tiny-rm", "mod:f", answer_format]
    assert list_specs(items) == (
        "python:reward_len",
        "python:reward_len_2",
        "org/tiny-rm",
        "mod:f",
        "rlhf_dist.rewards.tasks:answer_format",
    )
    assert is_model_name("org/tiny-rm") and is_model_name("/tmp/rm") and is_model_name("rm")
    assert not is_model_name("mod:f") and not is_model_name("python:f") and not is_model_name("")


def test_a_reward_model_goes_in_reward_functions_not_reward_function():
    from rlhf_dist.config import ConfigError, config_from_dict
    from rlhf_dist.config.validation import validate

    good = {"model": {"policy": "p"}, "data": {"train": "t.jsonl"}}
    validate(config_from_dict(good | {"reward": {"functions": ["org/tiny-rm"]}}), "ppo")
    with pytest.raises(ConfigError, match=r"reward\.function: expected 'module:callable'"):
        validate(config_from_dict(good | {"reward": {"function": "org/tiny-rm"}}), "ppo")


def test_a_missing_reward_model_path_in_the_list_is_one_line_before_torch(tmp_path):
    from rlhf_dist.config import ConfigError, config_from_dict
    from rlhf_dist.config.paths import check_stage_inputs

    (tmp_path / "policy").mkdir()
    rows = tmp_path / "p.jsonl"
    rows.write_text('{"prompt": "a"}\n')
    functions = ["mod:f", str(tmp_path / "no_rm")]
    cfg = {"model": {"policy": str(tmp_path / "policy")}, "data": {"train": str(rows)}}
    cfg = config_from_dict(cfg | {"reward": {"functions": functions}})
    with pytest.raises(ConfigError, match=r"^reward\.functions: model path '.*no_rm' does not"):
        check_stage_inputs(cfg, "ppo")
    check_stage_inputs(cfg, "sft")  # a stage that reads no reward


def test_sample_rows_carry_each_rows_trained_length_beside_its_extra_columns():
    from rlhf_dist.rollout.batch import RolloutBatch
    from rlhf_dist.trainers.ppo.stats import sample_rows

    fields = {f.name: None for f in dataclasses.fields(RolloutBatch)}
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    fields |= {"response_mask": mask, "scores": torch.tensor([1.0, 0.5, 0.0])}
    kl = torch.tensor([[0.1, 0.2, 0.3, 0.0], [0.5, 0.0, 0.0, 0.0], [0.0] * 4])
    rows = sample_rows(["a", "b", "c"], ["x y z", "w", ""], RolloutBatch(**fields), kl,
                       [{"chars": 5}, {}, {}])  # fmt: skip
    assert [r["length"] for r in rows] == [3, 1, 0]  # the mask's true tokens, by hand
    assert rows[0] == {"prompt": "a", "response": "x y z", "score": 1.0,
                       "kl": pytest.approx(0.6), "length": 3, "chars": 5}  # fmt: skip
    assert "length" in SAMPLE_COLUMNS  # log_extra cannot overwrite it
