"""distributed/process_exit.py: a process that made a gloo group ends with its atexit
handlers run and its output flushed, then leaves with its exit code at once; one that
made none gets its code back to exit normally."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import atexit, sys
from pathlib import Path
import torch
import torch.distributed as dist
from rlhf_dist.distributed.process_exit import end_process
from rlhf_dist.distributed.weight_sync import SyncGroup, free_port

atexit.register(lambda: Path(sys.argv[1]).write_text("atexit ran"))
if sys.argv[2] == "group":
    group = SyncGroup("127.0.0.1", free_port(), 0, 1, 30.0)
    t = group.broadcast(torch.arange(4.0))
print("buffered, no newline", end="")
code = end_process(3)
print(f" returned {code}")
sys.exit(code)
"""


def run(tmp_path: Path, kind: str) -> tuple[subprocess.CompletedProcess, Path]:
    marker = tmp_path / f"{kind}.txt"
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT), str(marker), kind],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return proc, marker


def test_a_process_with_a_gloo_group_leaves_at_once_after_its_atexit_handlers(tmp_path):
    proc, marker = run(tmp_path, "group")
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert proc.stdout == "buffered, no newline"  # flushed; nothing after end_process ran
    assert marker.read_text() == "atexit ran"


def test_a_process_without_one_gets_its_code_back(tmp_path):
    proc, marker = run(tmp_path, "none")
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert proc.stdout == "buffered, no newline returned 3\n"
    assert marker.read_text() == "atexit ran"
