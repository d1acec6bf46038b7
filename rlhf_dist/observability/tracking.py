"""Metrics sink: metrics.jsonl always; W&B / TensorBoard / trackio through Accelerate's trackers;
distributions, samples and alerts as JSON lines; a progress bar and one compact console
line per logged step.

Only the main process writes. Callers pass values already reduced (or gathered) over all
ranks. Files under <output_dir>: metrics.jsonl, distributions.jsonl, samples.jsonl,
alerts.jsonl (formats in docs/metrics.md).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import torch

from rlhf_dist.config import Config, RunConfig, save_config, to_dict
from rlhf_dist.files import atomic_write_text

QUANTILES = {
    "p01": 0.01,
    "p05": 0.05,
    "p25": 0.25,
    "p50": 0.5,
    "p75": 0.75,
    "p95": 0.95,
    "p99": 0.99,
}
HISTOGRAM_BINS = 30
FILES = ("metrics.jsonl", "distributions.jsonl", "samples.jsonl", "alerts.jsonl")
# Trackers whose package has W&B's Histogram(np_histogram=...) and Table(columns, data).
WANDB_LIKE = ("wandb", "trackio")


def _media_types(tracker: str) -> ModuleType:
    """The package of a WANDB_LIKE tracker (imported when used: both are optional here)."""
    if tracker == "wandb":
        import wandb

        return wandb
    import trackio

    return trackio


class MainProcess(Protocol):
    """The part of distributed.Runtime the metrics sink uses: who writes, and the trackers
    (this layer cannot import it)."""

    @property
    def is_main(self) -> bool: ...
    def barrier(self) -> None: ...
    def print(self, *args: Any, **kwargs: Any) -> None: ...
    def start_trackers(self, project: str, config: dict, init_kwargs: dict) -> None: ...
    def log_scalars(self, values: dict, step: int) -> None: ...
    def tracker(self, name: str) -> Any: ...
    def finish_trackers(self) -> None: ...


class Resumed(Protocol):
    """The part of checkpoint.Checkpoint open_run reads (a sibling layer: not importable)."""

    path: Path
    step: int


def _plain(value: Any) -> Any:
    """A metric value as JSON takes it: a tensor's number, non-finite floats as text."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible as text
    return value


def _keep_rows_up_to(path: Path, step: int) -> None:
    """Start a JSON-lines file afresh, or on resume keep its rows of steps <= `step` (rows
    logged after the checkpoint will be logged again)."""
    kept = []
    if step > 0 and path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line + "\n")
            except json.JSONDecodeError:
                break  # a line cut short by a kill: it and anything after are dropped
    atomic_write_text(path, "".join(kept))


def histogram(values: torch.Tensor) -> dict:
    """Histogram, quantiles and mean of a 1-D tensor (float64 for stable quantiles)."""
    v = values.detach().double().flatten()
    v = v[torch.isfinite(v)]
    if v.numel() == 0:
        return {"n": 0}
    lo, hi = float(v.min()), float(v.max())
    hi = hi if hi > lo else lo + 1e-6
    counts = torch.histc(v, bins=HISTOGRAM_BINS, min=lo, max=hi)
    edges = torch.linspace(lo, hi, HISTOGRAM_BINS + 1)
    qs = torch.quantile(v, torch.tensor(list(QUANTILES.values()), dtype=torch.float64))
    return {
        "n": int(v.numel()),
        "mean": float(v.mean()),
        "edges": edges.tolist(),
        "counts": [int(c) for c in counts.tolist()],
        "quantiles": dict(zip(QUANTILES, qs.tolist())),
    }


def flat_config(tree: dict, prefix: str = "") -> dict:
    """{"ppo.actor.lr": 1e-5, ...} with only int/float/str/bool values (TensorBoard's
    hparams accept nothing else; None and lists become text)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= flat_config(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = (
                value if isinstance(value, (int, float, str, bool)) else str(value)
            )
    return out


class MetricsLogger:
    """One stage's metrics sink under output_dir (main process only; other ranks' calls
    return at once). resume_step: the checkpoint's step, whose later rows are dropped
    from the files since they will be logged again; total_steps: for the ETA and the
    progress bar (0: unknown)."""

    def __init__(
        self,
        runtime: MainProcess,
        output_dir: str | Path,
        run_cfg: RunConfig,
        config_dict: dict,
        stage: str,
        resume_step: int = 0,
        total_steps: int = 0,
    ) -> None:
        self.runtime, self.stage = runtime, stage
        self.dir = Path(output_dir)
        self.path = self.dir / "metrics.jsonl"
        self.trackers = tuple(run_cfg.trackers)
        self.start, self.resume_step, self.total = time.time(), resume_step, total_steps
        self.bar = None
        self.created_dir = False  # set by open_run: whether the run made output_dir
        if not runtime.is_main:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        for name in FILES:
            _keep_rows_up_to(self.dir / name, resume_step)
        if self.trackers:
            kwargs = {
                "wandb": {
                    "name": f"{self.dir.name}-{stage}",
                    "mode": run_cfg.wandb_mode,
                    "dir": str(self.dir),
                },
                # trackio keeps its own store ($TRACKIO_DIR); a resumed run continues its run.
                "trackio": {
                    "name": f"{self.dir.name}-{stage}",
                    "resume": "allow" if resume_step else "never",
                },
            }
            runtime.start_trackers(run_cfg.project, flat_config(config_dict), kwargs)
        if run_cfg.progress and total_steps and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, initial=resume_step, desc=stage, dynamic_ncols=True)

    def _append(self, name: str, rows: list[dict]) -> None:
        with (self.dir / name).open("a", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)

    def log(self, step: int, metrics: dict, console_keys: tuple[str, ...] = ()) -> None:
        """Append a metrics row, send its numbers to the trackers, print one line."""
        if not self.runtime.is_main:
            return
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._append("metrics.jsonl", [row])
        if self.trackers:
            numbers = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
            self.runtime.log_scalars(numbers, step)
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
        if console_keys:
            self._print(self._line(step, row, console_keys))

    def _line(self, step: int, row: dict, keys: tuple[str, ...]) -> str:
        shown = " ".join(
            f"{k.split('/')[-1]}={row[k]:.4g}" for k in keys if isinstance(row.get(k), (int, float))
        )
        elapsed = time.time() - self.start
        eta = ""
        if self.total and step > self.resume_step:
            eta = f", eta {elapsed / (step - self.resume_step) * (self.total - step):.0f}s"
        return f"[{self.stage} {step}/{self.total or '?'}] {shown} ({elapsed:.0f}s{eta})"

    def _print(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def log_distributions(self, step: int, named: dict[str, torch.Tensor]) -> dict[str, float]:
        """Histograms of all-rank values -> distributions.jsonl, W&B / trackio / TensorBoard
        histograms; returns their quantiles as `dist/<name>/<q>` for the metrics row."""
        if not self.runtime.is_main:
            return {}
        rows: list[dict] = []
        quantiles: dict[str, float] = {}
        for name, values in named.items():
            h = histogram(values)
            if h["n"]:
                rows.append({"step": step, "name": name, **h})
                quantiles |= {f"dist/{name}/{q}": v for q, v in h["quantiles"].items()}
        self._append("distributions.jsonl", rows)
        self._tracker_histograms(step, rows, named)
        return quantiles

    def _tracker_histograms(self, step: int, rows: list[dict], named: dict) -> None:
        for name in WANDB_LIKE:
            if name in self.trackers:
                lib = _media_types(name)
                hists = {
                    f"dist/{r['name']}": lib.Histogram(np_histogram=(r["counts"], r["edges"]))
                    for r in rows
                }
                self.runtime.tracker(name).log(hists, step=step)
        if "tensorboard" in self.trackers:
            writer = self.runtime.tracker("tensorboard")
            for r in rows:
                values = named[r["name"]].detach().double().flatten()
                writer.add_histogram(
                    f"dist/{r['name']}", values[torch.isfinite(values)].numpy(), step
                )

    def log_samples(self, step: int, samples: list[dict]) -> None:
        """Rows {prompt, prompt_index, response, score, kl} -> samples.jsonl and a W&B /
        trackio table."""
        if not self.runtime.is_main or not samples:
            return
        rows = [{"step": step, **{k: _plain(v) for k, v in s.items()}} for s in samples]
        self._append("samples.jsonl", rows)
        columns = list(rows[0])
        for name in WANDB_LIKE:
            if name in self.trackers:
                lib = _media_types(name)
                table = lib.Table(columns=columns, data=[[r[c] for c in columns] for r in rows])
                self.runtime.tracker(name).log({"samples": table}, step=step)

    def log_alerts(self, step: int, alerts: list[tuple[str, str]]) -> None:
        """New alerts: printed once, appended to alerts.jsonl."""
        if not self.runtime.is_main or not alerts:
            return
        self._append("alerts.jsonl", [{"step": step, "name": n, "message": m} for n, m in alerts])
        for name, message in alerts:
            self._print(f"[{self.stage} {step}] ALERT {name}: {message}")

    def discard(self) -> None:
        """Close, and remove what this run wrote: config.yaml and the row files, then the
        directory if open_run created it and nothing else is in it (a tracker's own files
        keep it). For a run that fails before its first step completes (docs/architecture.md
        section 7); a resumed run keeps everything."""
        self.close()
        if not self.runtime.is_main or self.resume_step:
            return
        for name in (*FILES, "config.yaml"):
            (self.dir / name).unlink(missing_ok=True)
        if self.created_dir and not any(self.dir.iterdir()):
            self.dir.rmdir()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.trackers and self.runtime.is_main:
            self.runtime.finish_trackers()


def open_run(
    cfg: Config,
    runtime: MainProcess,
    stage: str,
    ckpt: Resumed | None = None,
    total_steps: int = 0,
) -> tuple[Path, MetricsLogger]:
    """Write config.yaml and open metrics.jsonl (keeping rows up to the checkpoint).

    ckpt: the checkpoint.Checkpoint a run resumes from, or None. Called only once data
    and models have loaded, so that a user mistake found while loading leaves no
    half-written output directory behind.
    """
    out = Path(cfg.run.output_dir)
    created = not out.exists()
    if runtime.is_main:
        save_config(cfg, out)
    runtime.barrier()
    if ckpt:
        runtime.print(f"{stage}: resuming from {ckpt.path} (step {ckpt.step})")
    start = ckpt.step if ckpt else 0
    logger = MetricsLogger(runtime, out, cfg.run, to_dict(cfg), stage, start, total_steps)
    logger.created_dir = created  # MetricsLogger.discard removes only what this run made
    return out, logger


def write_summary(runtime: MainProcess, out: Path, summary: dict) -> None:
    """summary.json under `out` (main process only)."""
    if runtime.is_main:
        atomic_write_text(out / "summary.json", json.dumps(summary, indent=2) + "\n")
