"""Seven reward functions written as TRL's docs write them (issue 49): a user's module that
the command-line and 2-rank tests copy beside their data and name as
`reward.functions=[trl_docs_rewards:reward_len, ...]`. Not imported by the test suite."""

import asyncio
import re


def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


def format_reward(completions, **kwargs):
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    return [1.0 if re.match(pattern, c) else 0.0 for c in completions]


def movie_only(prompts, completions, **kwargs):
    return [len(c) / 10 if "movie" in p else None for p, c in zip(prompts, completions)]


def length_in_tokens(completion_ids, **kwargs):
    return [len(ids) for ids in completion_ids]


def step_aware(completions, trainer_state, **kwargs):
    return [min(1.0, trainer_state.global_step / 10)] * len(completions)


def logs_a_metric(completions, log_metric, **kwargs):
    log_metric("mean_len", sum(len(c) for c in completions) / len(completions))
    return [0.0] * len(completions)


async def async_reward(prompts, completions, **kwargs):
    await asyncio.sleep(0.01)
    return [1.0 if "movie" in p else None for p in prompts]
