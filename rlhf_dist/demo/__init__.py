"""The offline demo task: synthetic reviews, gold reward, local tokenizer and tiny Llama models."""

from __future__ import annotations

from rlhf_dist.demo.task import (
    CATEGORIES,
    NEGATIVE,
    POSITIVE,
    TaskFiles,
    bayes_accuracy,
    bt_label,
    build_tiny_models,
    build_tokenizer,
    gold_reward,
    gold_reward_fn,
    gold_rewards,
    make_prompt,
    positive_word_reward,
    sample_response,
    tiny_llama_config,
    write_task,
)

__all__ = [
    "CATEGORIES",
    "NEGATIVE",
    "POSITIVE",
    "TaskFiles",
    "bayes_accuracy",
    "bt_label",
    "build_tiny_models",
    "build_tokenizer",
    "gold_reward",
    "gold_reward_fn",
    "gold_rewards",
    "make_prompt",
    "positive_word_reward",
    "sample_response",
    "tiny_llama_config",
    "write_task",
]
