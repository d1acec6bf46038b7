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
    # each label is the shape's colour (read from the pixels) or the annotator's swap of it
    for row in rows:
        present = {c for n, c in row["images"][0].getcolors(1 << 16)}
        (truth,) = [name for name, rgb in task.COLOURS.items() if rgb in present]
        label = row["messages"][1]["content"][0]["text"]
        assert label in (truth, task.SWAPS.get(truth))
    clean = task.sft_rows(30, colours=("red", "blue"), swap_rate=0.0)
    assert {r["messages"][1]["content"][0]["text"] for r in clean} == {"red", "blue"}
    held = task.held_out_rows(120)
    assert {r["answer"] for r in held} == set(task.COLOURS)
    sft_pixels = {r["images"][0].tobytes() for r in rows}
    assert not sft_pixels & {r["image"].tobytes() for r in held}
    assert not sft_pixels & {r["image"].tobytes() for r in task.prompt_rows(120)}


def test_annotator_swaps_its_pairs_at_its_rate_and_nothing_else():
    swapped = {c: 0 for c in task.COLOURS}
    for seed in range(2000):
        for colour in task.COLOURS:
            label = task.annotator_label(colour, seed)
            assert label in (colour, task.SWAPS.get(colour))
            swapped[colour] += label != colour
            assert task.annotator_label(colour, seed, rate=0.0) == colour
            assert task.annotator_label(colour, seed, rate=1.0) == task.SWAPS.get(colour, colour)
    for colour, n in swapped.items():  # binomial(2000, 0.6): sd 0.011 of a share
        assert n == 0 if colour not in task.SWAPS else abs(n / 2000 - task.SWAP_RATE) < 0.05
    assert task.annotator_label("red", 7) == task.annotator_label("red", 7)  # seeded
    # swaps of distant hues (L1 RGB distance 350-550; the neighbours orange-red, purple-blue
    # and yellow-green, 140-250, left GRPO too little to learn: docs/vision.md)
    for a, b in task.SWAPS.items():
        assert sum(abs(x - y) for x, y in zip(task.COLOURS[a], task.COLOURS[b])) > 300


def test_accuracy_evaluator():
    rows = task.held_out_rows(10)
    assert task.accuracy(lambda rs: [r["answer"] for r in rs], rows) == 1.0
    assert task.accuracy(lambda rs: ["nothing"] * len(rs), rows) == 0.0
    half = task.accuracy(lambda rs: [r["answer"] if i % 2 else "x" for i, r in enumerate(rs)], rows)
    assert half == pytest.approx(0.5)
