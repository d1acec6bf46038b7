"""Verifiable tasks (docs/grpo.md, "Verifiable tasks"): `data.train=reasoning_gym:TASK?...`
specs (config/tasks.py) and their rows (data/tasks.py), the shipped rewards
(rewards/tasks.py: the task's own scorer, math-verify, the answer format) on hand-made
completions, and the one-line errors for a bad spec or a missing tasks extra, raised
before any model loads."""

from __future__ import annotations

import sys

import pytest
import reasoning_gym

import rlhf_dist
from rlhf_dist.config import (
    Config,
    ConfigError,
    DataConfig,
    ModelConfig,
    RewardConfig,
    validate,
)
from rlhf_dist.config.tasks import REWARD_MODULE, REWARD_PACKAGES, TaskSpec, parse_task_spec
from rlhf_dist.data import inputs
from rlhf_dist.data.rows import load_data, load_rows
from rlhf_dist.data.tasks import task_rows
from rlhf_dist.rewards import tasks
from rlhf_dist.rewards.scoring import RewardFunction
from rlhf_dist.rewards.tasks import answer_format, as_number, final_answer, last_number, math_verify

ARITHMETIC = "reasoning_gym:basic_arithmetic?size=6&seed=3"
INSTALL_LINE = "pip install 'rlhf_dist[tasks]'"


def ppo_config(**data) -> Config:
    return Config(
        model=ModelConfig(policy="tiny"),
        data=DataConfig(**data),
        reward=RewardConfig(function="rlhf_dist.rewards.tasks:reasoning_gym"),
    )


# -- the spec ---------------------------------------------------------------------------


def test_a_spec_parses_into_task_size_seed_system_prompt_and_the_tasks_options():
    spec = parse_task_spec(
        "reasoning_gym:basic_arithmetic?size=2000&seed=7&max_terms=3&operators=[+, -]"
        "&allow_negation=false&system_prompt=direct",
        "data.train",
    )
    assert spec == TaskSpec(
        "basic_arithmetic",
        2000,
        7,
        "direct",
        (("max_terms", 3), ("operators", ["+", "-"]), ("allow_negation", False)),
    )
    assert spec.seeds == range(7, 2007)
    defaults = parse_task_spec("reasoning_gym:leg_counting", "data.train")
    assert (defaults.size, defaults.seed, defaults.system_prompt) == (500, 0, "default")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("reasoning_gym:?size=3", "names no task: expected reasoning_gym:TASK?size=N&seed=S"),
        ("reasoning_gym:basic-arithmetic", "names no task"),
        ("reasoning_gym:basic_arithmetic?size", "'size' in "),
        ("reasoning_gym:basic_arithmetic?size=3&size=4", "size is given twice"),
        ("reasoning_gym:basic_arithmetic?size=0", "size=0 in "),
        ("reasoning_gym:basic_arithmetic?seed=-1", "seed=-1 in "),
        ("reasoning_gym:basic_arithmetic?seed=true", "seed=True in "),
        ("reasoning_gym:basic_arithmetic?system_prompt=3", "system_prompt=3 in "),
    ],
)
def test_a_malformed_spec_is_one_line_naming_data_train_at_validation(value, message):
    with pytest.raises(ConfigError) as e:
        validate(ppo_config(train=value), "ppo")
    text = str(e.value)
    assert text.startswith("data.train: ") and message in text and "\n" not in text


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("reasoning_gym:no_such_task", "reasoning-gym has no task 'no_such_task'"),
        ("reasoning_gym:composite", "reasoning-gym has no task 'composite'"),
        ("reasoning_gym:basic_arithmetic?colour=3", "basic_arithmetic has no option 'colour'"),
        ("reasoning_gym:basic_arithmetic?max_terms=1", "refuses its options: max_terms must be"),
        ("reasoning_gym:basic_arithmetic?system_prompt=terse", "system_prompt='terse': expected"),
    ],
)
def test_what_only_reasoning_gym_knows_is_one_line_naming_the_key_when_rows_load(value, message):
    with pytest.raises(ConfigError) as e:
        load_rows(value, "data.train")
    assert str(e.value).startswith("data.train: ") and message in str(e.value)
    assert "\n" not in str(e.value)


def test_held_out_rows_from_overlapping_seeds_are_refused_naming_data_eval():
    cfg = ppo_config(
        train="reasoning_gym:basic_arithmetic?size=2000&seed=0",
        eval="reasoning_gym:basic_arithmetic?size=100&seed=1",
    )
    with pytest.raises(ConfigError, match=r"^data\.eval: .*seeds 1\.\.100.*set seed=2000 or more"):
        validate(cfg, "ppo")
    for eval_spec in (
        "reasoning_gym:basic_arithmetic?size=100&seed=2000",
        "reasoning_gym:chain_sum?size=100&seed=0",  # another task: other rows
    ):
        validate(ppo_config(train=cfg.data.train, eval=eval_spec), "ppo")


# -- the rows ---------------------------------------------------------------------------


def test_rows_are_chat_prompts_with_reasoning_gyms_entry_as_columns():
    rows = load_rows(ARITHMETIC, "data.train")
    entries = reasoning_gym.create_dataset("basic_arithmetic", size=6, seed=3)
    system = reasoning_gym.utils.SYSTEM_PROMPTS["default"]
    assert len(rows) == 6
    for row, entry in zip(rows, entries):
        assert row == {
            "prompt": [
                {"role": "system", "content": system},
                {"role": "user", "content": entry["question"]},
            ],
            "question": entry["question"],
            "answer": entry["answer"],
            "metadata": entry["metadata"],
            "task": ARITHMETIC,
        }
    bare = load_rows(ARITHMETIC + "&system_prompt=none", "data.train")
    assert [r["prompt"] for r in bare] == [[r["prompt"][1]] for r in rows]


def test_held_out_rows_leave_out_the_questions_data_train_holds():
    # chain_sum draws the same small sums from different seeds: 4 of these 200 are in
    # the 2000 training rows (counted when this test was written).
    train = "reasoning_gym:chain_sum?size=2000&seed=0"
    held_out = "reasoning_gym:chain_sum?size=200&seed=2000"
    rows = load_data(DataConfig(train=train, eval=held_out), "eval")
    all_rows = task_rows(held_out, "data.eval")
    train_questions = {r["question"] for r in load_rows(train, "data.train")}
    assert len(all_rows) == 200 and len(rows) == 196
    assert rows == [r for r in all_rows if r["question"] not in train_questions]


# -- a missing tasks extra --------------------------------------------------------------


def test_without_reasoning_gym_a_task_spec_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` fails
    with pytest.raises(ConfigError) as e:
        validate(ppo_config(train=ARITHMETIC), "ppo")
    assert str(e.value) == (
        "data.train: reasoning_gym tasks need the reasoning-gym package, which is not "
        f"installed: {INSTALL_LINE}"
    )
    with pytest.raises(ConfigError, match=r"^data\.eval: reasoning_gym tasks need"):
        load_rows("reasoning_gym:basic_arithmetic?seed=999", "data.eval")  # not made before


def test_without_math_verify_its_reward_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)
    cfg = ppo_config(train="rows.jsonl")
    for reward in (
        RewardConfig(function=f"{REWARD_MODULE}:math_verify"),
        RewardConfig(functions=[f"{REWARD_MODULE}:answer_format", f"{REWARD_MODULE}:math_verify"]),
    ):
        with pytest.raises(ConfigError) as e:
            validate(Config(model=cfg.model, data=cfg.data, reward=reward), "ppo")
        assert str(e.value).endswith(
            f"{REWARD_MODULE}:math_verify needs the math-verify package, which is not "
            f"installed: {INSTALL_LINE}"
        )
    validate(Config(model=cfg.model, data=cfg.data, reward=RewardConfig(
        function=f"{REWARD_MODULE}:answer_format")), "ppo")  # fmt: skip
    with pytest.raises(ImportError, match=r"math-verify package: pip install 'rlhf_dist\[tasks\]'"):
        math_verify([None], ["\\boxed{1}"], answer=["1"])


def test_the_python_api_stops_on_a_missing_extra_before_any_model_loads(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    missing = tmp_path / "no_model_here"  # loading it would fail with another error
    with pytest.raises(ConfigError, match=r"^data\.train: reasoning_gym tasks need"):
        rlhf_dist.grpo(
            {"model.policy": str(missing), "data.train": ARITHMETIC},
            reward_fn=tasks.reasoning_gym,
            overrides=[f"run.output_dir={tmp_path / 'run'}"],
        )
    assert not (tmp_path / "run").exists()


def test_a_task_spec_is_no_hub_dataset_in_a_model_card():
    from rlhf_dist.trainers.publish import on_hub

    assert not on_hub(ARITHMETIC) and on_hub("openai/gsm8k")


def test_a_shipped_reward_given_to_the_api_goes_in_by_its_module_name():
    assert inputs.package_spec(tasks.math_verify) == f"{REWARD_MODULE}:math_verify"
    assert inputs.package_spec(lambda p, r: r) is None
    assert (
        inputs.package_spec(test_the_python_api_stops_on_a_missing_extra_before_any_model_loads)
        is None
    )
    assert set(REWARD_PACKAGES) <= {n for n in dir(tasks) if callable(getattr(tasks, n))}


# -- the rewards ------------------------------------------------------------------------


def columns(rows: list[dict]) -> dict:
    return {k: [r[k] for r in rows] for k in ("task", "answer", "metadata", "question")}


def test_the_reasoning_gym_reward_is_the_tasks_scorer_on_the_last_answer_tags():
    rows = load_rows(ARITHMETIC, "data.train")[:4]
    gold = [r["answer"] for r in rows]
    responses = [
        f"Think. <answer> {gold[0]} </answer>",  # stripped, as reasoning-gym's extract_answer
        f"<answer>{gold[1]}9</answer> no, <answer>{gold[1]}</answer>",  # the last tags count
        gold[2],  # no tags: nothing to score
        f"<answer>{gold[3]}9</answer>",  # contains the answer: the scorer's partial credit
    ]
    scores = tasks.reasoning_gym(None, responses, **columns(rows))
    partial = len(gold[3]) / (len(gold[3]) + 1)  # basic_arithmetic's default scorer
    assert scores == pytest.approx([1.0, 1.0, 0.0, partial])


def test_a_scorer_that_raises_on_a_malformed_answer_scores_zero_said_once(capsys):
    rows = load_rows("reasoning_gym:prime_factorization?size=2&seed=0", "data.train")
    responses = ["<answer>hello world</answer>", "<answer>hello there</answer>"]
    assert tasks.reasoning_gym(None, responses, **columns(rows)) == [0.0, 0.0]
    right = [f"<answer>{r['answer']}</answer>" for r in rows]
    assert tasks.reasoning_gym(None, right, **columns(rows)) == [1.0, 1.0]
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        "reasoning_gym reward: prime_factorization's score_answer raised ValueError on an "
        "answer; such answers score 0.0"
    ]


@pytest.mark.parametrize(
    ("response", "gold", "score"),
    [
        ("so the answer is \\boxed{1/2}.", "0.5", 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("<answer>1/2</answer>", "0.5", 1.0),  # reasoning-gym's tags
        ("<answer>\\boxed{3}</answer>", "3", 1.0),
        ("\\boxed{x = 3}", "3", 1.0),
        ("\\boxed{2\\sqrt{2}}", "2\\sqrt{2}", 1.0),
        ("\\boxed{1/3}", "0.5", 0.0),  # wrong
        ("the answer is 0.5", "0.5", 0.0),  # no box, no tags
        ("\\boxed{0.5} or maybe \\boxed{7}", "0.5", 0.0),  # the last box counts
        ("\\boxed{0.5} and then \\boxed{0.", "0.5", 1.0),  # a box cut short is no box
    ],
)
def test_the_math_verify_reward_on_hand_cases(response, gold, score):
    assert math_verify(None, [response], answer=[gold]) == [score]


def test_math_verify_reads_solution_when_there_is_no_answer_and_refuses_neither(capsys):
    solution = "Halve 1: the result is $\\boxed{\\tfrac12}$."
    assert math_verify(None, ["\\boxed{0.5}", "\\boxed{2}"], solution=[solution] * 2) == [1, 0]
    assert math_verify(None, ["\\boxed{2}"], answer=["2"], solution=["\\boxed{3}"]) == [1.0]
    with pytest.raises(ValueError, match="`answer` \\(or `solution`\\) column"):
        math_verify(None, ["\\boxed{2}"])
    # A gold math-verify cannot read (blank, a row without one) scores 0, never 1
    # (open-r1#293), said once per gold.
    golds = [" ", " ", None]
    assert math_verify(None, ["\\boxed{1}", "<answer> </answer>", "\\boxed{1}"], golds) == [0, 0, 0]
    assert capsys.readouterr().err.count("cannot parse the gold answer") == 2


def test_math_verify_works_off_the_main_thread_as_reward_timeout_s_runs_it():
    # With a timeout the reward runs in a worker thread (rewards/retry.py), where
    # math-verify's own timeouts, SIGALRM alarms, would raise.
    fn = RewardFunction(math_verify, timeout_s=60.0)
    scores = fn([None] * 2, ["\\boxed{1/2}", "\\boxed{2}"], [{"answer": "0.5"}] * 2)
    assert scores.tolist() == [1.0, 0.0]


@pytest.mark.parametrize(
    ("response", "score"),
    [
        ("<think>2 + 2</think><answer>4</answer>", 1.0),
        ("The sum is \\boxed{4}.", 1.0),
        ("<answer>  </answer>", 0.0),
        ("<answer>4</answer> or <answer>5</answer>", 0.0),
        ("\\boxed{4} or \\boxed{5}", 0.0),
        ("\\boxed{}", 0.0),
        ("4", 0.0),
        ("<answer>4", 0.0),
    ],
)
def test_the_format_reward_wants_exactly_one_final_answer(response, score):
    assert answer_format(None, [response]) == [score]


def test_final_answer_is_the_last_box_or_tags_whichever_ends_later():
    assert final_answer("a \\boxed{x^{2}} b") == "x^{2}"  # braces nest
    assert final_answer("\\boxed {7}") == "7"
    assert final_answer("<answer>3</answer> then \\boxed{4}") == "4"
    assert final_answer("\\boxed{4} then <answer> 3 </answer>") == "3"
    assert final_answer("\\boxed{") is None and final_answer("<answer> </answer>") is None


@pytest.mark.parametrize(
    ("response", "gold", "score"),
    [
        ("The answer to this arithmetic problem is 13.", "13", 1.0),
        ("5 - 9 = -4.", "-4", 1.0),  # a minus after a space is a sign
        ("The answer is 4.", "-4", 0.0),  # the sign matters
        ("5-9 gives 4", "-4", 0.0),  # a minus after a digit is subtraction: 5, 9, 4
        ("It is 4.0 exactly", "4", 1.0),  # as numbers, not strings
        ("1/2 of it: 0.5", "1/2", 1.0),
        ("about 1,000 apples", "1000", 1.0),  # a thousands comma
        ("3, 4", "4", 1.0),  # a list's comma is no thousands comma
        ("first 7, then 8", "7", 0.0),  # the last number counts
        ("<answer>7</answer> and 8 more", "7", 1.0),  # the final answer's region, when there is one
        ("\\boxed{x = 12} done, 3", "12", 1.0),
        ("no number at all", "3", 0.0),
        ("x2", "2", 1.0),  # a digit after a letter still counts
    ],
)
def test_the_last_number_reward_on_hand_cases(response, gold, score):
    assert last_number(None, [response], answer=[gold]) == [score]


def test_last_number_scores_an_unreadable_gold_zero_said_once(capsys):
    assert last_number(None, ["7", "seven", "7"], answer=["seven", "seven", "7"]) == [0, 0, 1]
    assert capsys.readouterr().err.count("is not a number") == 1
    assert as_number(" -3.50 ") == as_number("-7/2") and as_number("1/0") is None


def test_last_number_property_any_prose_then_the_answer_scores_one():
    # Property: prose with numbers, then the gold as the last number, scores 1; the same
    # with any other last number scores 0.
    import random

    rng = random.Random(0)
    words = ["the", "sum", "is", "so", "we", "get", "answer", ":", "=", "+", "then"]
    for _ in range(200):
        gold = rng.randint(-99, 99)
        prose = " ".join(rng.choice(words + [str(rng.randint(0, 9))]) for _ in range(8))
        other = gold + rng.choice([-2, -1, 1, 2])
        assert last_number(None, [f"{prose} {gold}."], answer=[str(gold)]) == [1.0]
        assert last_number(None, [f"{prose} {other}"], answer=[str(gold)]) == [0.0]
