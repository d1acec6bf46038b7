"""A reward built to collapse a policy's entropy (tests/integration/test_integration_entropy.py):
it pays for one word and nothing else, so the best policy emits that word at every step
with probability 1, an entropy of 0 nats per token."""

from __future__ import annotations

WORD = "great"  # a word of the demo task's vocabulary (rlhf_dist/demo/task.py)


def one_word(prompts: list[str], responses: list[str]) -> list[float]:
    """The share of a response's words that are WORD, in [0, 1]."""
    del prompts
    out = []
    for response in responses:
        words = response.split()
        out.append(sum(w == WORD for w in words) / max(len(words), 1))
    return out


def repetition(prompts: list[str], responses: list[str]) -> list[float]:
    """The share of a response's words that are its most frequent word, in [0, 1]."""
    del prompts
    out = []
    for response in responses:
        words = response.split()
        out.append(max((words.count(w) for w in set(words)), default=0) / max(len(words), 1))
    return out
