"""In-process stand-ins for RLHF_DIST_FAULT's SIGKILL (on the tests' path, like spies.py).

A real kill is tested in tests/distributed/test_dist_resume.py (subprocesses, SIGKILL);
these raise at the same fault point instead, so a test can stop and resume a run inside
the session's one runtime: nothing after the point runs, and the resumed run starts from
what is on disk.
"""

from __future__ import annotations

# Metric prefixes that measure the machine, not the training run: left out of comparisons.
MACHINE = ("time/", "throughput/", "memory/")


class Killed(Exception):
    """Raised where checkpoint.maybe_fault would SIGKILL the process."""


def untimed(rows: list[dict]) -> list[dict]:
    """metrics.jsonl rows without the machine's figures."""
    return [{k: v for k, v in r.items() if not k.startswith(MACHINE)} for r in rows]


def kill_at(monkeypatch, module, point: str, step: int) -> None:
    """Make `module`'s maybe_fault raise Killed at (point, step), e.g. ("update", 2)."""

    def fault(at: str, n: int) -> None:
        if (at, n) == (point, step):
            raise Killed

    monkeypatch.setattr(module, "maybe_fault", fault)
