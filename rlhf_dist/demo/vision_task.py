"""The vision demo's task: name the colour of the one shape drawn in a generated image
(docs/vision.md, "The vision demo task").

Each image is a noisy grey background of a random size with one filled square, circle or
triangle of one of `COLOURS`, at a random place and size; the question is always the same, so
the answer is in the pixels only. Rows come in TRL 1.16's vision formats:

- `sft_rows`: `messages` (user turn = an image part + the question, assistant turn = the colour)
  and an `images` column holding one PIL image, as TRL's SFTTrainer reads them;
- `prompt_rows` / `held_out_rows`: a conversational `prompt` with an image part, an `image`
  column and an `answer` column, as TRL's GRPOTrainer reads them; `colour_reward` scores
  completions in TRL's reward-function convention.

Room for GRPO: the SFT labels come from an annotator with a systematic bias (`SWAPS`): a
red shape is labelled "green", a blue one "yellow" and a purple one "orange" in `SWAP_RATE`
of the rows, as human labels err in patterns. The swapped pairs are hues the tower tells
apart easily, so what SFT learns is the annotator's bias, not a visual confusion: greedy
decoding names the three swapped colours wrongly while their true names keep some
probability. GRPO's reward checks the colour against the image's truth, so its samples
that name the true colour are reinforced (docs/vision.md, "The vision demo", has the
per-colour measurement, and why confusing neighbouring hues left too little to learn).
Every colour is still an SFT answer: one never shown would get almost no probability and
no reward could teach it. Seeds keep the splits
apart: row i of a split is drawn from `split seed + i`, and the held-out split's seed is far
from the others'.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from PIL import Image, ImageDraw

COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 180, 40),
    "blue": (30, 60, 220),
    "yellow": (230, 210, 20),
    "purple": (140, 40, 170),
    "orange": (240, 130, 10),
}
SFT_ROWS = 384  # the labelled rows the demo's SFT stage sees
# The annotator's bias: a shape of a key's colour is labelled with the value in SWAP_RATE of
# the SFT rows (the held-out and GRPO rows keep the truth).
SWAPS = {"red": "green", "blue": "yellow", "purple": "orange"}
SWAP_RATE = 0.6
SHAPES = ("square", "circle", "triangle")
QUESTION = "what colour is the shape ?"
SIZES = ((56, 56), (56, 84), (84, 56), (84, 84), (112, 56))  # (width, height), multiples of 28
SFT_SEED, PROMPT_SEED, HELD_OUT_SEED = 0, 10_000, 1_000_000


def all_words() -> tuple[str, ...]:
    """Every word a prompt or an answer of the task holds (for word-level test tokenizers)."""
    return (*QUESTION.split(), *COLOURS)


def draw(colour: str, rng: random.Random) -> Image.Image:
    """One RGB image: grey noise, one filled shape of `colour` (a key of COLOURS)."""
    width, height = rng.choice(SIZES)
    base = rng.randint(90, 160)
    image = Image.new("RGB", (width, height), (base, base, base))
    noise = Image.effect_noise((width, height), 20).convert("RGB")
    image = Image.blend(image, noise, 0.3)
    side = rng.randint(min(width, height) // 3, min(width, height) * 2 // 3)
    x, y = rng.randint(0, width - side), rng.randint(0, height - side)
    box = (x, y, x + side, y + side)
    pen = ImageDraw.Draw(image)
    shape = rng.choice(SHAPES)
    if shape == "square":
        pen.rectangle(box, fill=COLOURS[colour])
    elif shape == "circle":
        pen.ellipse(box, fill=COLOURS[colour])
    else:
        pen.polygon([(x, y + side), (x + side, y + side), (x + side // 2, y)], fill=COLOURS[colour])
    return image


def _example(seed: int, colours: Sequence[str]) -> tuple[Image.Image, str]:
    rng = random.Random(seed)
    colour = rng.choice(list(colours))
    return draw(colour, rng), colour


def annotator_label(colour: str, seed: int, rate: float = SWAP_RATE) -> str:
    """The SFT label of a `colour` shape in the row drawn from `seed`: SWAPS[colour] with
    probability `rate` (a draw of its own, so the image is the same at any rate)."""
    swapped = colour in SWAPS and random.Random(f"label-{seed}").random() < rate
    return SWAPS[colour] if swapped else colour


def _user_turn() -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}


def prompt_rows(
    n: int, seed: int = PROMPT_SEED, colours: Sequence[str] = tuple(COLOURS)
) -> list[dict[str, Any]]:
    """`n` GRPO rows {prompt, image, answer}; row i drawn from seed + i."""
    rows = []
    for i in range(n):
        image, colour = _example(seed + i, colours)
        rows.append({"prompt": [_user_turn()], "image": image, "answer": colour})
    return rows


def held_out_rows(n: int) -> list[dict[str, Any]]:
    """`n` held-out rows over every colour, from seeds no training split draws."""
    return prompt_rows(n, seed=HELD_OUT_SEED)


def sft_rows(
    n: int = SFT_ROWS,
    seed: int = SFT_SEED,
    colours: Sequence[str] = tuple(COLOURS),
    swap_rate: float = SWAP_RATE,
) -> list[dict[str, Any]]:
    """`n` SFT rows {messages, images}, colours drawn from `colours`, labelled by the
    annotator (`annotator_label`; swap_rate 0: the true colours)."""
    rows = []
    for i in range(n):
        image, colour = _example(seed + i, colours)
        label = annotator_label(colour, seed + i, swap_rate)
        answer = {"role": "assistant", "content": [{"type": "text", "text": label}]}
        rows.append({"messages": [_user_turn(), answer], "images": [image]})
    return rows


def completion_text(completion: Any) -> str:
    """A completion as TRL passes it to rewards: a string, or a list of messages whose last
    one is the assistant's (content a string or a list of text parts)."""
    if isinstance(completion, str):
        return completion
    content = completion[-1]["content"] if completion else ""
    if isinstance(content, str):
        return content
    return " ".join(part.get("text", "") for part in content if part.get("type") == "text")


def answer_of(completion: Any) -> str | None:
    """The colour a completion names: its first word, lower-cased, trailing stops removed;
    None when that is not a colour of the palette."""
    words = completion_text(completion).split()
    word = words[0].strip(".!,").lower() if words else ""
    return word if word in COLOURS else None


def colour_reward(completions: Sequence[Any], answer: Sequence[str], **kwargs: Any) -> list[float]:
    """TRL's reward convention: 1.0 when the completion's first word is the row's colour."""
    return [float(answer_of(c) == a) for c, a in zip(completions, answer, strict=True)]


def accuracy(
    answer_fn: Callable[[list[dict[str, Any]]], Sequence[Any]], rows: list[dict[str, Any]]
) -> float:
    """Share of `rows` (prompt rows) whose completion from `answer_fn(rows)` earns reward 1."""
    completions = answer_fn(rows)
    scores = colour_reward(completions, [row["answer"] for row in rows])
    return sum(scores) / len(rows) if rows else 0.0
