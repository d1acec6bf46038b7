"""Metrics sink: metrics.jsonl always, a compact console line, and optional trackers.

Only the main process writes. Callers pass values already reduced over all ranks.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path


def _plain(value):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible as text
    return value


class MetricsLogger:
    def __init__(
        self,
        runtime,
        output_dir: str | Path,
        run_cfg,
        config_dict: dict,
        stage: str,
        resume_step: int = 0,
    ):
        self.runtime = runtime
        self.stage = stage
        self.path = Path(output_dir) / "metrics.jsonl"
        self.trackers = tuple(run_cfg.trackers)
        self.start = time.time()
        if runtime.is_main:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._keep_rows_up_to(resume_step)
        if self.trackers:
            runtime.accelerator.init_trackers(
                run_cfg.project,
                config=config_dict,
                init_kwargs={"wandb": {"name": f"{Path(output_dir).name}-{stage}"}},
            )

    def _keep_rows_up_to(self, step: int) -> None:
        """Start metrics.jsonl afresh, or on resume keep the rows of steps <= `step` (rows
        logged after the checkpoint will be logged again)."""
        kept = []
        if step > 0 and self.path.exists():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    if json.loads(line).get("step", 0) <= step:
                        kept.append(line + "\n")
                except json.JSONDecodeError:
                    break  # a line cut short by the kill: it and anything after are dropped
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, self.path)

    def log(self, step: int, metrics: dict, console_keys: tuple[str, ...] = ()) -> None:
        if not self.runtime.is_main:
            return
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        if self.trackers:
            self.runtime.accelerator.log(
                {k: v for k, v in row.items() if isinstance(v, (int, float))}, step=step
            )
        if console_keys:
            shown = " ".join(
                f"{k.split('/')[-1]}={row[k]:.4g}"
                for k in console_keys
                if isinstance(row.get(k), (int, float))
            )
            elapsed = time.time() - self.start
            print(f"[{self.stage} {step}] {shown} ({elapsed:.0f}s)", flush=True)

    def close(self) -> None:
        if self.trackers:
            self.runtime.accelerator.end_training()
