"""One retry loop for every call that reaches outside the process: a user's reward
function, a remote reward model, a judge endpoint (docs/architecture.md section 7,
reward failures; docs/rewards.md).

An exception or a timeout is retried `retries` times after retry_delay_s,
2 x retry_delay_s, ... (exponential backoff), one stderr line per retry; whatever ends the
attempts is a RewardFunctionError naming the call.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from rlhf_dist.errors import RewardFunctionError

T = TypeVar("T")


class CallTimeout(Exception):
    """A call that did not return within its timeout (reward.timeout_s)."""


def call_with_retries(
    call: Callable[[], T],
    label: str,
    retries: int = 0,
    retry_delay_s: float = 1.0,
    timeout_s: float | None = None,
) -> T:
    """`call()`'s result, trying again after an exception or a timeout.

    label: what the messages call it ("reward.function mod:fn", "reward.url"); it must not
    hold secrets, and neither may the exceptions' texts (remote.py redacts its own).
    timeout_s (None: wait for ever): the call runs in a daemon worker thread and the caller
    stops waiting after timeout_s; a thread cannot be killed, so a hung call keeps running
    in the background, its result dropped.
    """
    for attempt in range(retries + 1):
        try:
            return _call_once(call, label, timeout_s)
        except Exception as e:
            what = "timed out" if isinstance(e, CallTimeout) else f"raised {type(e).__name__}"
            failure = f"{label} {what}: {e}"
            if attempt == retries:
                tries = f" (after {attempt + 1} attempts)" if attempt else ""
                raise RewardFunctionError(failure + tries) from e
            delay = retry_delay_s * 2**attempt
            print(
                f"{failure}; retrying in {delay:g} s ({attempt + 1} of {retries} retries)",
                file=sys.stderr,
                flush=True,
            )
            time.sleep(delay)
    raise AssertionError("unreachable")  # the loop returns or raises


def _call_once(call: Callable[[], T], label: str, timeout_s: float | None) -> T:
    if timeout_s is None:
        return call()
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["out"] = call()
        except BaseException as e:  # handed to the caller's thread
            box["error"] = e

    worker = threading.Thread(target=work, name=label, daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():  # left running: a thread cannot be stopped from outside
        raise CallTimeout(f"no answer within reward.timeout_s={timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["out"]
