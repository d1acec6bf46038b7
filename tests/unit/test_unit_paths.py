"""config/paths.py: the local inputs a stage reads, checked before torch loads."""

from pathlib import Path

import pytest

from rlhf_dist.config import load_config
from rlhf_dist.config.paths import (
    check_stage_inputs,
    data_file_problem,
    missing_model,
    stage_models,
)
from rlhf_dist.errors import ConfigError


def test_missing_model_paths_by_hand(tmp_path):
    assert missing_model("/nonexistent/m", "model.policy") == (
        "model.policy: model path '/nonexistent/m' does not exist"
    )
    assert missing_model("./nope", "model.reward") is not None
    assert missing_model(str(tmp_path), "model.policy") is None
    assert missing_model("HuggingFaceTB/SmolLM2-135M-Instruct", "model.policy") is None  # hub


@pytest.mark.parametrize(
    ("name", "text", "why"),
    [
        ("rows.jsonl", '{"prompt": "a"}\n', None),
        ("blank.jsonl", "\n  \n", "is empty"),
        ("list.json", " [ ] ", "has no rows (an empty JSON list)"),
        ("header.csv", "prompt,response\n\n", "has a header line but no rows"),
        ("rows.csv", "prompt\nhello\n", None),
    ],
)
def test_data_file_problems_by_hand(tmp_path, name, text, why):
    path = tmp_path / name
    path.write_text(text)
    expected = None if why is None else f"data.train: data file {str(path)!r} {why}"
    assert data_file_problem(str(path), "data.train") == expected


def test_absent_files_and_names_that_are_not_files(tmp_path):
    absent = str(tmp_path / "absent.jsonl")
    assert (
        data_file_problem(absent, "data.eval") == f"data.eval: data file {absent!r} does not exist"
    )
    assert data_file_problem("trl-lib/tldr", "data.train") is None  # a hub dataset
    assert data_file_problem("reasoning_gym:basic_arithmetic", "data.train") is None


def _cfg(tmp_path, *overrides):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "a", "response": "b"}\n')
    return load_config(None, [f"model.policy={tmp_path}", f"data.train={data}", *overrides])


def test_only_what_the_stage_reads_is_checked(tmp_path):
    # one YAML for every stage may name the reward model a later stage writes
    cfg = _cfg(tmp_path, "model.reward=./runs/rm/final")
    check_stage_inputs(cfg, "sft")
    with pytest.raises(ConfigError, match=r"^model.reward: model path './runs/rm/final'"):
        check_stage_inputs(cfg, "ppo")
    with pytest.raises(ConfigError, match=r"^model.reward: "):
        check_stage_inputs(cfg, "rm")  # the reward model trains from model.reward when set
    assert [k for k, _ in stage_models(cfg, "rm")] == ["model.reward"]
    assert [k for k, _ in stage_models(_cfg(tmp_path), "rm")] == ["model.policy"]


def test_an_empty_eval_file_is_refused(tmp_path):
    empty = Path(tmp_path / "eval.jsonl")
    empty.write_text("")
    with pytest.raises(ConfigError, match=r"^data.eval: data file .* is empty$"):
        check_stage_inputs(_cfg(tmp_path, f"data.eval={empty}"), "dpo")
