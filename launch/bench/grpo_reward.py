"""The GRPO benchmark's reward, importable from both venvs (no rlhf_dist, no torch).

A response earns the share of its words that also appear in the prompt (a copy reward):
cheap, deterministic and different between samples, so every GRPO group has a spread and
the update does real work on both sides.
"""

from __future__ import annotations


def _text(x) -> str:
    """A plain text, a message list (the last message's content) or a TRL completion."""
    if isinstance(x, list):
        return str(x[-1]["content"]) if x else ""
    return str(x)


def copy_share(prompt, response) -> float:
    seen = set(_text(prompt).lower().split())
    words = _text(response).lower().split()
    return sum(w in seen for w in words) / len(words) if words else 0.0


def reward(prompts, responses) -> list[float]:
    """rlhf_dist's reward.function signature: (prompts, responses) -> scores."""
    return [copy_share(p, r) for p, r in zip(prompts, responses)]


def trl_reward(prompts, completions, **kwargs) -> list[float]:
    """TRL's reward_funcs signature."""
    return [copy_share(p, c) for p, c in zip(prompts, completions)]
