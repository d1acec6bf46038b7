"""An environment whose episodes last 1 turn on rank 0 and 3 turns on rank 1, for the
uneven-turns lock-step test (tests/distributed/test_dist_agent.py). Importable by the
launched ranks through PYTHONPATH."""

from __future__ import annotations

import os


class UnevenTurns:
    def __init__(self):
        self.turns_left = 3 if os.environ.get("RANK", "0") == "1" else 1

    def reset(self, prompt):
        return [{"role": "user", "content": prompt}]

    def step(self, messages):
        self.turns_left -= 1
        if self.turns_left <= 0:
            return [], True, float(len(messages[-1]["content"].split()))
        return [{"role": "user", "content": "more"}], False, None


def make():
    return UnevenTurns()
