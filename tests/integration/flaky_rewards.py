"""A reward function that fails on purpose, by call number (test_integration_reward_failures).

Not a test module: the CLI runs it as `reward.function=flaky_rewards:flaky` with this
directory on PYTHONPATH, as a user's module is. Environment variables pick the failures:
FLAKY_DOWN_FROM=N (every call from the N-th on raises: a reward server that went down),
FLAKY_FAIL_CALLS=a,b (those calls raise once), FLAKY_HANG_CALLS=a,b (those calls sleep
FLAKY_HANG_S seconds before answering). Otherwise it scores as the demo's
positive_word_reward does.
"""

import os
import time

from rlhf_dist.demo.task import positive_word_reward

CALLS = 0


def _calls(name: str) -> set[int]:
    return {int(c) for c in os.environ.get(name, "").split(",") if c}


def flaky(prompts, responses):
    global CALLS
    CALLS += 1
    down_from = int(os.environ.get("FLAKY_DOWN_FROM", "0"))
    if down_from and down_from <= CALLS:
        raise ConnectionError(f"reward server down (call {CALLS})")
    if CALLS in _calls("FLAKY_FAIL_CALLS"):
        raise ConnectionError(f"reward server hiccup (call {CALLS})")
    if CALLS in _calls("FLAKY_HANG_CALLS"):
        time.sleep(float(os.environ.get("FLAKY_HANG_S", "5")))
    return positive_word_reward(prompts, responses)
