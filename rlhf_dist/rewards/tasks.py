"""Reward functions for verifiable tasks, in our form `fn(prompts, responses, **columns)`
(docs/rewards.md): point `reward.function` or `reward.functions` at
`rlhf_dist.rewards.tasks:NAME`, or pass the function to the Python API.

- `reasoning_gym`: the task's own `score_answer` on the answer in the completion's last
  <answer></answer> tags, for rows of `data.train=reasoning_gym:TASK` (data/tasks.py).
- `math_verify`: 1.0 where the completion's final answer (its last \\boxed{...} or
  <answer></answer>) equals the row's `answer` (else `solution`, TRL's column) as
  mathematics (math-verify: 1/2 = 0.5 = \\frac{1}{2}), else 0.0.
- `answer_format`: 1.0 where the completion gives exactly one final answer in that form.
- `last_number`: 1.0 where the last number of the completion's final answer (or, without
  one, of the whole completion) equals the row's numeric `answer`: a lenient reading for
  small models that answer in prose and never write tags (the task demo, docs/demo.md).

The first two need the tasks extra; config validation names it in one line when a spec
names them and the package is missing, and calling them without it raises the same line.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from rlhf_dist.config.tasks import INSTALL
from rlhf_dist.data.tasks import task_dataset

if TYPE_CHECKING:
    from rlhf_dist.rewards.judge import Prompt

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
BOXED = "\\boxed"
# A number in running text: a minus is its sign unless a word character or a point comes
# just before it ("5-3" reads 5 and 3; "= -4" reads -4). Thousands commas are dropped first.
NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?|(?<=[\w.])\d+(?:\.\d+)?")
THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
# math-verify's own timeout per parse / comparison where it can have one (below), seconds.
MATH_VERIFY_TIMEOUT_S = 5
_said: set[str] = set()  # warnings already printed by this process, said once each


def reasoning_gym(
    prompts: Sequence[Prompt],
    responses: Sequence[str],
    task: Sequence[str],
    answer: Sequence[Any],
    metadata: Sequence[Any],
    question: Sequence[Any] | None = None,
) -> list[float]:
    """reasoning-gym's score of each response: its task's `score_answer(answer, entry)` on
    the text inside the response's last <answer></answer> (reasoning-gym's prompts ask for
    them; stripped of surrounding whitespace, as reasoning-gym's extract_answer does), 0.0
    without one. The task is rebuilt from the row's `task` spec, once per process, because
    some scorers read the task's configuration. Scores are in [0, 1]; some tasks give
    partial credit (an answer that contains the right one scores its share of the length).
    A scorer that raises on a malformed answer (boxnet, coin_flip, prime_factorization do)
    scores it 0.0, said once per task on stderr."""
    questions = question if question is not None else [None] * len(responses)
    scores = []
    for response, spec, gold, meta, q in zip(responses, task, answer, metadata, questions):
        given = _last_tag(response)
        if given is None:
            scores.append(0.0)
            continue
        dataset = task_dataset(spec, "reward.function")
        entry = {"question": q, "answer": gold, "metadata": meta}
        try:
            scores.append(float(dataset.score_answer(answer=given.strip(), entry=entry)))
        except Exception as e:  # a third-party scorer on a model's malformed answer
            name = meta.get("source_dataset", spec) if isinstance(meta, dict) else spec
            _say_once(
                f"reasoning_gym reward: {name}'s score_answer raised {type(e).__name__} on "
                "an answer; such answers score 0.0"
            )
            scores.append(0.0)
    return scores


def math_verify(
    prompts: Sequence[Prompt],
    responses: Sequence[str],
    answer: Sequence[Any] | None = None,
    solution: Sequence[Any] | None = None,
) -> list[float]:
    """1.0 where the response's final answer (`final_answer`) equals the row's gold as
    mathematics, else 0.0 (no final answer: 0.0). The gold is the row's `answer` (a final
    answer: "72", "0.5", "\\frac{1}{2}", "x = 3"), else its `solution` (TRL's accuracy
    reward column: a worked solution with its answer in \\boxed{}). A gold that
    math-verify cannot parse scores every response 0.0, said once per gold on stderr: a
    reward of 1.0 for an unparseable gold would reward anything (open-r1#293)."""
    golds = [a if a is not None else s for a, s in _pairs(answer, solution, len(responses))]
    parse, verify, timeout = _math_verify()
    scores = []
    for response, gold in zip(responses, golds):
        given = final_answer(response)
        if given is None:
            scores.append(0.0)
            continue
        text = "" if gold is None else str(gold)
        # A bare answer is read as the content of a \boxed{}, math-verify's most lenient
        # LaTeX reading ("2\sqrt{2}" outside one parses as 2).
        expected = parse(text if BOXED in text else f"{BOXED}{{{text}}}", parsing_timeout=timeout)
        if not expected:
            _say_once(f"math_verify reward: cannot parse the gold answer {text!r}; scored 0.0")
            scores.append(0.0)
            continue
        got = parse(f"{BOXED}{{{given}}}", parsing_timeout=timeout)
        scores.append(float(verify(expected, got, timeout_seconds=timeout)))
    return scores


def answer_format(prompts: Sequence[Prompt], responses: Sequence[str]) -> list[float]:
    """1.0 where the response gives exactly one final answer: one <answer></answer> with
    non-blank text (reasoning-gym's form), or, without tags, one complete \\boxed{...}
    that is not blank; else 0.0. Two answers are 0.0, so hedging does not pay."""
    scores = []
    for response in responses:
        tags = ANSWER_TAG.findall(response)
        if tags:
            ok = len(tags) == 1 and bool(tags[0].strip())
        else:
            boxes = _boxes(response)
            ok = len(boxes) == 1 and bool(boxes[0][1].strip())
        scores.append(float(ok))
    return scores


def last_number(
    prompts: Sequence[Prompt], responses: Sequence[str], answer: Sequence[Any]
) -> list[float]:
    """1.0 where the response's last number equals the row's `answer` as a number
    (exact rationals: "-4" = "-4.0", "0.5" = "1/2"), else 0.0. The number is read from the
    response's final answer (`final_answer`: its last <answer></answer> or \\boxed{}) when it
    has one, else from the whole response, so "5 - 9 = -4." and "The answer is -4" both
    score 1 against "-4", and tags are not required. A gold that is not a number scores
    every response 0.0, said once per gold on stderr (rewarding anything against an
    unreadable gold is open-r1#293's bug). Pure Python: no extra needed."""
    scores = []
    for response, gold in zip(responses, answer):
        expected = as_number(str(gold))
        if expected is None:
            _say_once(f"last_number reward: the gold answer {gold!r} is not a number; scored 0.0")
            scores.append(0.0)
            continue
        region = final_answer(response)
        got = _last_number(region if region is not None else response)
        scores.append(float(got is not None and got == expected))
    return scores


def as_number(text: str) -> Fraction | None:
    """`text` as an exact rational ("-4", "0.50", "3/4", "1,000"), None if it is not one."""
    try:
        return Fraction(THOUSANDS.sub("", text.strip()))
    except (ValueError, ZeroDivisionError):
        return None


def _last_number(text: str) -> Fraction | None:
    found = NUMBER.findall(THOUSANDS.sub("", text))
    return Fraction(found[-1]) if found else None


def final_answer(text: str) -> str | None:
    """The text of the completion's final answer: the last complete \\boxed{...} or the
    last <answer>...</answer>, whichever ends later (a box inside the tags: the box's
    text); None when there is neither or it is blank."""
    tag = list(ANSWER_TAG.finditer(text))
    boxes = _boxes(text)
    if tag and (not boxes or boxes[-1][0] <= tag[-1].end()):
        inner = _boxes(tag[-1].group(1))
        found = inner[-1][1] if inner else tag[-1].group(1)
    elif boxes:
        found = boxes[-1][1]
    else:
        return None
    return found.strip() or None


def _last_tag(text: str) -> str | None:
    tags = ANSWER_TAG.findall(text)
    return tags[-1] if tags else None


def _boxes(text: str) -> list[tuple[int, str]]:
    """(end offset, inner text) of each complete top-level \\boxed{...}, left to right;
    braces nest, and one left open (a completion cut short) is not a box."""
    found, start = [], text.find(BOXED)
    while start != -1:
        i = start + len(BOXED)
        while i < len(text) and text[i] == " ":
            i += 1
        end = _closing_brace(text, i) if i < len(text) and text[i] == "{" else None
        if end is not None:
            found.append((end + 1, text[i + 1 : end]))
        start = text.find(BOXED, end + 1 if end is not None else start + len(BOXED))
    return found


def _closing_brace(text: str, opening: int) -> int | None:
    """Index of the brace closing the one at `opening`, or None if it never closes."""
    depth = 0
    for j in range(opening, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return j
    return None


def _pairs(
    answer: Sequence[Any] | None, solution: Sequence[Any] | None, n: int
) -> Iterator[tuple[Any, Any]]:
    if answer is None and solution is None:
        raise ValueError(
            "the math_verify reward reads the rows' `answer` (or `solution`) column, and the "
            "data has neither"
        )
    return zip(answer or [None] * n, solution or [None] * n)


def _math_verify() -> tuple[Callable[..., list], Callable[..., bool], int | None]:
    """(parse, verify, timeout) of math-verify. Its timeouts are SIGALRM alarms, which
    Python allows in the main thread only: with reward.timeout_s set the reward runs in a
    worker thread, where math-verify raises unless its timeouts are off (None); there
    reward.timeout_s bounds the whole call instead (rewards/retry.py)."""
    try:
        import math_verify as mv
    except ImportError:
        raise ImportError(
            f"the math_verify reward needs the math-verify package: {INSTALL}"
        ) from None
    main = threading.current_thread() is threading.main_thread()
    if not main:
        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).addFilter(_NO_TIMEOUT_NOTICE)  # added once: same object
    return mv.parse, mv.verify, MATH_VERIFY_TIMEOUT_S if main else None


class _NoTimeoutNotice(logging.Filter):
    """Drops math-verify's warning that its timeout is off: reward.timeout_s is the bound."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


_NO_TIMEOUT_NOTICE = _NoTimeoutNotice()


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        print(message, file=sys.stderr, flush=True)
