"""The iteration timer both TRL benchmark scripts hand to TRL's trainers (imports
transformers only, so each TRL venv can load it whatever its trl version)."""

from __future__ import annotations

import time

from transformers import TrainerCallback


class IterationTimer(TrainerCallback):
    """Wall-clock seconds of each update (= iteration) of a TRL training loop: from the
    start of training or the previous `on_step_end` to the next one."""

    def __init__(self):
        self.seconds: list[float] = []
        self.last = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.last = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self.seconds.append(now - self.last)
        self.last = now
