"""The local files a stage reads, checked before torch loads (standard library only).

A missing model directory or an empty data file is then one line within a second of the
command, not after ~7 s of imports; the loaders (models/loading.py, data/rows.py) make
the same checks with the same words for the Python API. Only what the stage reads is
checked: one YAML shared by every stage may name a reward model that a later stage
writes.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rlhf_dist.errors import ConfigError

if TYPE_CHECKING:
    from rlhf_dist.config.schema import Config

# Data files read by extension; anything else is a hub dataset name (or a directory).
LOCAL_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def missing_model(path: str, key: str) -> str | None:
    """The error for a model path written as local (".", "/", "~") that does not exist;
    None for an existing one or a hub name."""
    if path.startswith((".", "/", "~")) and not Path(path).expanduser().exists():
        return f"{key}: model path {path!r} does not exist"
    return None


def data_file_problem(source: str, key: str) -> str | None:
    """The error for a local data file (by extension) that is missing or holds no rows;
    None otherwise (a hub name, a task or Python spec, a file with rows)."""
    path = Path(source).expanduser()
    if path.suffix not in LOCAL_BUILDERS:
        return None
    if not path.is_file():
        return f"{key}: data file {source!r} does not exist"
    empty = why_no_rows(path)
    return f"{key}: data file {source!r} {empty}" if empty else None


def why_no_rows(path: Path) -> str | None:
    """Why a local data file holds no rows, or None if it may hold some. Checked before
    `datasets` reads it: that reports such files as "StopIteration" or "corresponds to no
    data", which does not tell the user the file is empty."""
    head = _non_blank(path, 3)
    if not head:
        return "is empty"
    if path.suffix == ".json" and head == b"[]":
        return "has no rows (an empty JSON list)"
    if path.suffix == ".csv" and not _csv_has_a_row(path):
        return "has a header line but no rows"
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        if pq.ParquetFile(path).metadata.num_rows == 0:
            return "has no rows"
    return None


def _non_blank(path: Path, limit: int) -> bytes:
    """Up to `limit` non-whitespace bytes from the start of a file (reads no further)."""
    found = b""
    with path.open("rb") as f:
        while len(found) < limit and (chunk := f.read(1 << 16)):
            found += b"".join(chunk.split())[: limit - len(found)]
    return found


def _csv_has_a_row(path: Path) -> bool:
    """A non-blank line after the header line."""
    with path.open("rb") as f:
        lines = (line for line in f if line.strip())
        return next(lines, None) is not None and next(lines, None) is not None


def stage_models(cfg: Config, stage: str) -> list[tuple[str, str]]:
    """(key, path) of the models `stage` loads: the policy (the reward model's base in
    rm unless model.reward is set), PPO's reward model and teacher, the reward models of
    reward.functions (PPO, eval), the tokenizer."""
    m = cfg.model
    models = [("model.reward", m.reward)] if stage == "rm" and m.reward else [("model.policy", m.policy)]  # fmt: skip
    if stage == "ppo":
        models += [("model.reward", m.reward), ("model.teacher", m.teacher)]
    if stage in ("ppo", "eval"):  # a reward model's path or hub id in reward.functions
        models += [("reward.functions", s) for s in cfg.reward.functions if ":" not in s]
    return [(k, p) for k, p in models + [("model.tokenizer", m.tokenizer)] if p]


def check_stage_inputs(cfg: Config, stage: str) -> None:
    """Raise the first of `stage`'s local inputs that is missing or empty (ConfigError);
    `eval` reads data.eval only."""
    problems = [missing_model(path, key) for key, path in stage_models(cfg, stage)]
    data = [("eval", cfg.data.eval)] + ([] if stage == "eval" else [("train", cfg.data.train)])
    problems += [data_file_problem(src, f"data.{w}") for w, src in data if src]
    first = next((p for p in problems if p), None)
    if first:
        raise ConfigError(first)
