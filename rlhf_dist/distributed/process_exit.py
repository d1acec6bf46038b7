"""Ending a process that made a gloo process group, without the interpreter's teardown.

A gloo group runs each collective on a worker thread of its own, and that thread drops
the finished work (and the tensors it holds, Python objects among them) only after it
has woken the caller. When the caller's main thread is by then in interpreter
finalization, the worker's tensor release asks for the GIL, CPython ends the thread
with a forced unwind, and the unwind through a noexcept C++ frame aborts the process:
"terminate called without an active exception", exit -6, after the run's work was done
(a core of one such rank: ProcessGroupGloo::runLoop -> ~AsyncBarrierWork ->
~AsyncBroadcastWork -> THPVariable_dealloc -> take_gil -> pthread_exit -> terminate).
When the group's destructor runs first instead, during finalization with the GIL held,
it joins that same worker, which waits for the GIL: the process never exits, and its
launcher waits with it. Destroying the group beforehand does not close the window.

So a process that made such a group ends with `end_process`: its atexit handlers run
and its output is flushed in a live interpreter, then os._exit skips finalization.
Everything the run wrote is already closed by then (checkpoints, metrics, trackers).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys

_made_group = False


def note_group() -> None:
    """Record that this process made a gloo group (the ranks' default group or a
    rollout server's weight-sync group)."""
    global _made_group
    _made_group = True


def end_process(code: int) -> int:
    """`code` back when this process made no gloo group; otherwise run the atexit
    handlers, flush stdout and stderr, and leave at once with `code` (never returns)."""
    if not _made_group:
        return code
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a reader gone, a stream closed
            stream.flush()
    os._exit(code)
