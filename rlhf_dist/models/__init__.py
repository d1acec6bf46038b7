"""The models of RLHF: loading the policy, reference, reward model and critic
(`loading`), the value model and the actor-critic module (`value`), and LoRA adapters
(`lora`). The public names of `loading` and `value` are importable from here.
"""

from __future__ import annotations

from rlhf_dist.models.loading import (
    DTYPES,
    disable_dropout,
    enable_gradient_checkpointing,
    frozen_dtype,
    generation_eos_ids,
    load_causal_lm,
    load_sequence_classifier,
    load_tokenizer,
    nf4_load_kwargs,
    policy_stop_ids,
    quiet_transformers,
    tokenizer_for,
    train_dtype,
    trained_load_dtype,
    upcast_trainable,
    uses_checkpointing,
)
from rlhf_dist.models.value import (
    HEAD_NAMES,
    ActorCritic,
    ValueModel,
    build_critic,
    sequence_scores,
    split_classifier,
    sub_state_dict,
)

__all__ = [
    "DTYPES",
    "HEAD_NAMES",
    "ActorCritic",
    "ValueModel",
    "build_critic",
    "disable_dropout",
    "enable_gradient_checkpointing",
    "frozen_dtype",
    "generation_eos_ids",
    "load_causal_lm",
    "load_sequence_classifier",
    "load_tokenizer",
    "nf4_load_kwargs",
    "policy_stop_ids",
    "quiet_transformers",
    "sequence_scores",
    "split_classifier",
    "sub_state_dict",
    "tokenizer_for",
    "train_dtype",
    "trained_load_dtype",
    "upcast_trainable",
    "uses_checkpointing",
]
