"""A reward built to collapse a policy's entropy (tests/integration/test_integration_entropy.py):
it pays for repeating one word, so the best policy says one word at every step with
probability 1, an entropy of 0 nats per token. Unlike a reward for one given word, every
response earns something (its most frequent word's share), so the samples of a prompt
differ in score at any entropy and GRPO always has a signal."""

from __future__ import annotations


def repetition(prompts: list[str], responses: list[str]) -> list[float]:
    """The share of a response's words that are its most frequent word, in [0, 1]."""
    del prompts
    out = []
    for response in responses:
        words = response.split()
        out.append(max((words.count(w) for w in set(words)), default=0) / max(len(words), 1))
    return out
