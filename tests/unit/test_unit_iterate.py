"""Pieces of `rlhf-dist iterate` (rlhf_dist/iterative.py): labellers, the labelled pair rows
(a normal preference file), the state file, derived stage configs, the per-round fault."""

from __future__ import annotations

import json
import math
import os
import random

import pytest

from rlhf_dist import iterative as it
from rlhf_dist.config import ConfigError, config_from_dict, to_dict, validate


def test_preference_value_reads_bools_and_probabilities_and_refuses_the_rest():
    assert it.preference_value(True, "f") == 1.0 and it.preference_value(False, "f") == 0.0
    assert it.preference_value(0.25, "f") == 0.25 and it.preference_value(1, "f") == 1.0
    assert it.preference_value(None, "f") is None  # does not apply (TRL's None)
    for bad in (1.5, -0.1, "a", float("nan")):
        with pytest.raises(it.LabellerError, match="iterate.labeller f"):
            it.preference_value(bad, "f")


def test_pairs_the_labeller_does_not_apply_to_are_skipped_and_counted(tmp_path):
    class OneRank:
        is_main = True

        def barrier(self):
            pass

    def movie_only(prompt, a, b):  # None: this labeller does not judge the other prompts
        return len(a) > len(b) if "movie" in prompt else None

    pairs = it.AnswerPairs(["a movie", "a book", "the movie", "a song"], ["xx"] * 4, ["y"] * 4)
    lab = it.FunctionLabeller(movie_only, "mod:movie_only")
    path = tmp_path / "r" / "pairs.jsonl"
    info = it.label_and_write(OneRank(), lab, pairs, path, 1, seed=0)
    assert info["skipped_pairs"] == 2 and info["pairs"] == 2 and info["p_chosen_mean"] == 1.0
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["a movie", "the movie"]
    assert all(r["chosen"] == "xx" and r["rejected"] == "y" for r in rows)


def test_draw_labels_hard_labels_are_exact_and_soft_ones_follow_p():
    rng = random.Random(0)
    assert it.draw_labels([1.0, 0.0, 1.0], rng) == [True, False, True]
    labels = it.draw_labels([0.8] * 4000, random.Random(1))
    assert abs(sum(labels) / 4000 - 0.8) < 0.03
    # A function of the seed: the same draws again.
    assert it.draw_labels([0.5] * 50, random.Random(2)) == it.draw_labels(
        [0.5] * 50, random.Random(2)
    )


def test_gold_labeller_is_bradley_terry_on_the_gold_reward():
    # gold = length / 10; pair ("aaaa"-like) 0.4 vs 0.2 at beta 10: sigmoid(2) = 0.8808.
    def gold(prompts, responses, finished):
        assert all(finished)
        return [len(r.split()) / 10 for r in responses]

    lab = it.GoldLabeller(gold, beta=10.0)
    p = lab.preferences(["q", "q"], ["a b c d", "a"], ["a b", "a"])
    assert p[0] == pytest.approx(1 / (1 + math.exp(-2.0)))
    assert p[1] == pytest.approx(0.5)


def test_function_labeller_calls_per_pair_and_names_itself_when_it_fails():
    lab = it.FunctionLabeller(lambda prompt, a, b: len(a) > len(b), "mod:longer")
    assert lab.preferences(["p", "p"], ["long", "s"], ["s", "long"]) == [1.0, 0.0]

    def broken(prompt, a, b):
        raise RuntimeError("down")

    with pytest.raises(it.LabellerError, match="mod:broken raised RuntimeError: down"):
        it.FunctionLabeller(broken, "mod:broken").preferences(["p"], ["a"], ["b"])


def test_pair_rows_order_by_label_and_drop_identical_answers():
    pairs = it.AnswerPairs(["p1", "p2", "p3"], ["x", "same", "u"], ["y", "same", "v"])
    rows, dropped = it.pair_rows(pairs, [0.9, 0.5, 0.3], [True, False, False], round_=2)
    assert dropped == 1
    assert rows[0] == {"prompt": "p1", "chosen": "x", "rejected": "y", "round": 2, "p_chosen": 0.9}
    assert rows[1]["chosen"] == "v" and rows[1]["rejected"] == "u"
    assert rows[1]["p_chosen"] == pytest.approx(0.7)


def test_written_pairs_are_a_preference_file_rlhf_dist_rm_reads(tmp_path):
    from rlhf_dist.data.rows import load_rows, preference_pairs
    from rlhf_dist.demo import task

    tok = task.build_tokenizer(tmp_path / "tok")
    pairs = it.AnswerPairs(
        ["review of the hotel :", [{"role": "user", "content": "review of the book :"}]],
        ["the room was great", "the plot was dull"],
        ["the bed was dirty", "the hero is lovely"],
    )
    rows, _ = it.pair_rows(pairs, [1.0, 0.0], [True, False], 1)
    path = it.write_jsonl(tmp_path / "a" / "pairs.jsonl", rows[:1])
    assert not list(path.parent.glob("*.tmp"))
    data = config_from_dict({"data": {"max_prompt_length": 16, "max_length": 48}}).data
    got, report = preference_pairs(load_rows(str(path), "data.train"), tok, data)
    assert len(got) == 1 and report.kept == 1
    assert rows[1]["chosen"] == [{"role": "assistant", "content": "the hero is lovely"}]


def test_state_file_records_stages_and_resumes_only_when_asked(tmp_path):
    state = it.IterateState.load(tmp_path, "")
    assert state.stages(1) == [] and not state.done(1, "samples")
    state.finish(1, "samples", {"samples": {"new_pairs": 3}})
    state.finish(1, "rm")
    with pytest.raises(ConfigError, match="run.resume: .*--resume auto"):
        it.IterateState.load(tmp_path, "")
    again = it.IterateState.load(tmp_path, "auto")
    assert again.stages(1) == ["samples", "rm"] and again.done(1, "rm")
    assert not again.done(1, "ppo") and again.stages(2) == []
    assert again.entry(1) == {"samples": {"new_pairs": 3}}
    assert json.loads((tmp_path / it.STATE_FILE).read_text())["format"] == it.STATE_FORMAT
    assert not list(tmp_path.glob("*.tmp"))
    # Another rank's record: kept in memory, no file written.
    other = it.IterateState.load(tmp_path / "none", "")
    other.finish(1, "samples", write=False)
    assert other.done(1, "samples") and not (tmp_path / "none" / it.STATE_FILE).exists()


def _iterate_cfg(tmp_path, **iterate):
    return config_from_dict(
        {
            "run": {"output_dir": str(tmp_path / "it"), "seed": 5},
            "model": {"policy": "sft-dir"},
            "data": {"train": "prompts.jsonl", "eval": "held.jsonl"},
            "eval": {"gold_function": "rlhf_dist.demo.task:gold_reward_eval"},
            "iterate": iterate,
        }
    )


def test_stage_configs_chain_the_rounds_without_touching_the_iterate_config(tmp_path):
    cfg = _iterate_cfg(tmp_path)
    before = to_dict(cfg)
    lay = it.Layout(tmp_path / "it")
    rm1, rm2 = (it.stage_config(cfg, lay, k, "rm") for k in (1, 2))
    assert rm1.model.reward == "" and rm1.model.policy == "sft-dir"
    assert rm2.model.reward == str(lay.rm(1))  # continue: from RM_1
    assert rm2.data.train == str(lay.train_pairs(2)) and rm2.data.eval == ""
    assert rm2.run.output_dir == str(tmp_path / "it" / "round-2" / "rm") and rm2.run.seed == 6
    ppo2 = it.stage_config(cfg, lay, 2, "ppo")
    assert ppo2.model.policy == str(lay.round_dir(1) / "ppo" / "final")
    assert ppo2.model.reward == str(lay.rm(2)) and ppo2.run.resume == "auto"
    ev = it.stage_config(cfg, lay, 2, "eval")
    assert ev.model.policy == str(lay.round_dir(2) / "ppo" / "final")
    assert ev.eval.reference == "sft-dir" and ev.run.resume == ""
    fresh = it.stage_config(_iterate_cfg(tmp_path, rm_init="fresh"), lay, 2, "rm")
    assert fresh.model.reward == "" and fresh.model.policy == "sft-dir"
    assert to_dict(cfg) == before


def test_only_the_last_rounds_ppo_pushes_to_the_hub(tmp_path):
    tree = to_dict(_iterate_cfg(tmp_path, rounds=3))
    tree["run"] |= {"push_to_hub": True, "hub_model_id": "me/m"}
    cfg, lay = config_from_dict(tree), it.Layout(tmp_path / "it")
    pushes = {
        (k, stage): it.stage_config(cfg, lay, k, stage).run.push_to_hub
        for k in (1, 2, 3)
        for stage in ("rm", "ppo", "eval")
    }
    assert [key for key, push in pushes.items() if push] == [(3, "ppo")]
    assert not it.stage_config(_iterate_cfg(tmp_path, rounds=3), lay, 3, "ppo").run.push_to_hub


def test_iterate_validation_names_the_key(tmp_path):
    validate(_iterate_cfg(tmp_path), "iterate")
    bad = {
        "iterate.rounds": {"rounds": 0},
        "iterate.label_beta": {"label_beta": -1.0},
        "iterate.labeller": {"labeller": "nocolon"},
        "iterate.rm_init": {"rm_init": "again"},
    }
    for name, values in bad.items():
        with pytest.raises(ConfigError, match=name):
            validate(_iterate_cfg(tmp_path, **values), "iterate")
    tree = to_dict(_iterate_cfg(tmp_path))
    tree["eval"]["gold_function"] = ""
    with pytest.raises(ConfigError, match="iterate.labeller: gold labels with eval.gold_function"):
        validate(config_from_dict(tree), "iterate")
    tree = to_dict(_iterate_cfg(tmp_path))
    tree["data"]["eval"] = ""
    with pytest.raises(ConfigError, match="data.eval: required by iterate"):
        validate(config_from_dict(tree), "iterate")
    tree = to_dict(_iterate_cfg(tmp_path))
    tree["rm"]["batch_size"], tree["rm"]["micro_batch_size"] = 3, 2
    with pytest.raises(ConfigError, match="rm.batch_size"):
        validate(config_from_dict(tree), "iterate")


def test_fault_is_armed_only_in_the_round_named(monkeypatch):
    monkeypatch.setenv("RLHF_DIST_FAULT", "rollout:2")
    monkeypatch.setenv(it.FAULT_ROUND_ENV, "2")
    with it.fault_armed(1):
        assert "RLHF_DIST_FAULT" not in os.environ
    assert os.environ["RLHF_DIST_FAULT"] == "rollout:2"
    with it.fault_armed(2):
        assert os.environ["RLHF_DIST_FAULT"] == "rollout:2"
    monkeypatch.delenv(it.FAULT_ROUND_ENV)
    with it.fault_armed(1):  # no round named: armed everywhere, as for any stage
        assert os.environ["RLHF_DIST_FAULT"] == "rollout:2"
