"""Writing files so that a reader (or a resumed run) never sees half of one.

Standard library only, so that every module (config.py included) can use it.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write `text` (UTF-8) to `path` through `<path>.tmp` and a rename; returns the path.

    A process killed at any moment leaves the old file or the new one, never a truncated
    one (a summary, a config or the `latest` checkpoint pointer cut short would be
    misread). Both the file and its directory are fsynced, so the rename also survives
    a machine crash.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    fsync_file(tmp)
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return path
