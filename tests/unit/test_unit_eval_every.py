"""trainers/common.evaluate_if_due, the one place every stage's evaluation during training
(run.eval_every) is decided, run and logged: every N steps and at the last, eval/<name>
rows with the step, the RNG streams as they were before."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import torch

from rlhf_dist.trainers.common import evaluate_if_due


class RowsLogger:
    def __init__(self):
        self.rows = []

    def log(self, step, metrics, console_keys=()):
        self.rows.append((step, metrics))


def _run(every: int, last: int, evaluate):
    cfg = SimpleNamespace(run=SimpleNamespace(eval_every=every))
    logger = RowsLogger()
    for step in range(1, last + 1):
        evaluate_if_due(cfg, None, logger, (step, last), evaluate)
    return logger.rows


def test_due_every_n_steps_and_at_the_last():
    def evaluate():
        return {"loss": 0.5, "accuracy": 1.0}

    rows = _run(3, 7, evaluate)
    assert [step for step, _ in rows] == [3, 6, 7]
    assert rows[0][1] == {"eval/loss": 0.5, "eval/accuracy": 1.0}
    assert [step for step, _ in _run(1, 3, evaluate)] == [1, 2, 3]
    assert _run(0, 5, evaluate) == []  # 0: only the stage's end-of-run evaluation
    assert _run(2, 4, None) == []  # no held-out data


def test_the_evaluation_leaves_the_rng_streams_as_they_were():
    def evaluate():  # an evaluation that samples from every generator
        return {"score": torch.rand(()).item() + np.random.rand() + random.random()}

    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    _run(1, 2, evaluate)
    after = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    expected = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(after[0], expected[0]) and (after[1] == expected[1]).all()
    assert after[2] == expected[2]
