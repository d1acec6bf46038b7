"""User reward functions with the mistakes users make (for tests/bad_inputs)."""


def raises(prompts, responses):
    raise ValueError("my scorer crashed")


def wrong_length(prompts, responses):
    return [1.0]


def nan_score(prompts, responses):
    return [float("nan")] * len(responses)


def text_score(prompts, responses):
    return ["high"] * len(responses)
