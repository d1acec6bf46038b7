"""The vision demo task (rlhf_dist/demo/vision_task.py): its rows in TRL's formats, the split
design that leaves room for GRPO, and the reward in TRL's calling convention."""

from __future__ import annotations

import random

import pytest
from PIL import Image

from rlhf_dist.demo import vision_task as task


def test_reward_hand_cases():
    completions = [
        "red",  # plain string, right
        [{"role": "assistant", "content": "Blue."}],  # conversational, case and stop ignored
        [{"role": "assistant", "content": [{"type": "text", "text": "green is it"}]}],  # parts
        "the shape is red",  # the first word is not a colour: no credit
        "purple",  # a colour, the wrong one
        "",
    ]
    answers = ["red", "blue", "green", "red", "orange", "red"]
    assert task.colour_reward(completions, answers, image=[None] * 6) == [1, 1, 1, 0, 0, 0]


def test_reward_property_only_the_named_colour_scores():
    rng = random.Random(0)
    for _ in range(200):
        truth, said = rng.choice(list(task.COLOURS)), rng.choice(list(task.COLOURS))
        text = rng.choice(["{}", "{}.", "{} !", " {} and more"]).format(
            said.upper() if rng.random() < 0.3 else said
        )
        assert task.colour_reward([text], [truth]) == [float(said == truth)]


def test_prompt_rows_in_trl_grpo_format():
    rows = task.prompt_rows(12)
    for row in rows:
        assert set(row) == {"prompt", "image", "answer"}
        (turn,) = row["prompt"]
        assert turn["role"] == "user" and [p["type"] for p in turn["content"]] == ["image", "text"]
        assert isinstance(row["image"], Image.Image) and row["image"].mode == "RGB"
        assert row["image"].size in task.SIZES and row["answer"] in task.COLOURS
    # the answer is in the pixels: the shape's colour is the image's most common non-grey one
    for row in rows:
        colours = dict((c, n) for n, c in row["image"].getcolors(1 << 16))
        assert colours.get(task.COLOURS[row["answer"]], 0) > 0
        others = [c for c in task.COLOURS if c != row["answer"]]
        assert all(colours.get(task.COLOURS[c], 0) == 0 for c in others)
    assert [r["answer"] for r in task.prompt_rows(12)] == [r["answer"] for r in rows]  # seeded


def test_sft_rows_and_splits():
    rows = task.sft_rows()
    assert len(rows) == task.SFT_ROWS
    for row in rows:
        user, assistant = row["messages"]
        assert user["role"] == "user" and assistant["role"] == "assistant"
        assert [p["type"] for p in user["content"]] == ["image", "text"]
        assert len(row["images"]) == 1 and isinstance(row["images"][0], Image.Image)
    # every colour is an answer SFT shows (a colour it never shows, GRPO would never sample)
    assert {row["messages"][1]["content"][0]["text"] for row in rows} == set(task.COLOURS)
    half = task.sft_rows(30, colours=("red", "blue"))
    assert {r["messages"][1]["content"][0]["text"] for r in half} == {"red", "blue"}
    held = task.held_out_rows(120)
    assert {r["answer"] for r in held} == set(task.COLOURS)
    sft_pixels = {r["images"][0].tobytes() for r in rows}
    assert not sft_pixels & {r["image"].tobytes() for r in held}
    assert not sft_pixels & {r["image"].tobytes() for r in task.prompt_rows(120)}


def test_accuracy_evaluator():
    rows = task.held_out_rows(10)
    assert task.accuracy(lambda rs: [r["answer"] for r in rs], rows) == 1.0
    assert task.accuracy(lambda rs: ["nothing"] * len(rs), rows) == 0.0
    half = task.accuracy(lambda rs: [r["answer"] if i % 2 else "x" for i, r in enumerate(rs)], rows)
    assert half == pytest.approx(0.5)
