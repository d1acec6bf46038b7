"""Reward functions with known defects, loaded by `module:callable` spec in test_unit_rollout.

Not a test module (no `test_` prefix): it is imported by name, the way a user's reward
module is, after the test puts tests/unit on sys.path.
"""

import math

import numpy as np

NOT_CALLABLE = 3.0


def length_reward(prompts, responses):
    """A well-behaved reward: the number of words of each response."""
    return [float(len(r.split())) for r in responses]


def int_reward(prompts, responses):
    """Plain ints are numbers too."""
    return [len(r.split()) for r in responses]


def raises(prompts, responses):
    raise KeyError("no score for this prompt")


def one_short(prompts, responses):
    return [0.0] * (len(responses) - 1)


def nan_score(prompts, responses):
    return [0.0] * (len(responses) - 1) + [math.nan]


def inf_score(prompts, responses):
    return [math.inf] * len(responses)


def text_score(prompts, responses):
    return ["0.5"] * len(responses)


def none_score(prompts, responses):
    return [None] * len(responses)


def numpy_float32_scores(prompts, responses):
    """Finite scores as a float32 array, as a numpy-based scorer would return them."""
    return np.full(len(responses), 0.5, dtype=np.float32)


def ties_on_some_prompts(prompts, responses):
    """Dynamic sampling's case (DAPO): every sample of a prompt with an even number of
    characters scores 1, so its group ties; the others score a checksum of the response
    in [0, 1) (different responses: different scores, whatever their length)."""
    import zlib

    return [
        1.0 if len(str(p)) % 2 == 0 else zlib.crc32(r.encode()) / 2**32
        for p, r in zip(prompts, responses)
    ]
