"""Fixtures of the real-model tests (the model itself: tests/conftest.py): the real
tokenizer exactly as each convention ships it, and tiny random Llamas that carry it (its
49,152-token vocabulary and ChatML template) for the quick convention checks.
"""

from __future__ import annotations

import pytest

from rlhf_dist.models import quiet_transformers

quiet_transformers()


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes tens of seconds on a 2-core CPU")


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
