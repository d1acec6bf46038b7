"""`module:callable` keys (reward.function, eval.gold_function, generation.tools, ...) find
the user's module in the current working directory also when the process did not put the
working directory on sys.path (the `rlhf-dist` console script, unlike `python -m`)."""

from __future__ import annotations

import os
import sys
import uuid

import pytest

from rlhf_dist.data.inputs import resolve_callable
from rlhf_dist.errors import ConfigError


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """A fresh working directory, with sys.path as the console script leaves it: neither
    the working directory nor "" (which stands for it) on it. Yields a unique module name,
    so no earlier import in this process can satisfy the lookup."""
    monkeypatch.chdir(tmp_path)
    cwd = os.getcwd()
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", cwd)])
    name = f"my_rewards_{uuid.uuid4().hex[:8]}"
    yield tmp_path, name
    for module in [m for m in sys.modules if m.startswith(name)]:
        del sys.modules[module]


def test_a_module_in_the_working_directory_is_found(user_dir):
    root, name = user_dir
    (root / f"{name}.py").write_text(
        "def score(prompts, responses):\n    return [0.25 for _ in responses]\n"
    )
    path_before = list(sys.path)
    fn = resolve_callable(f"{name}:score", "reward.function")
    assert fn(["p"], ["a", "b"]) == [0.25, 0.25]
    assert sys.path == path_before  # on sys.path for the import only


def test_a_package_with_relative_and_sibling_imports_is_found(user_dir):
    root, name = user_dir
    (root / f"{name}_helpers.py").write_text("OFFSET = 2\n")
    pkg = root / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "scale.py").write_text("FACTOR = 3\n")
    (pkg / "tools.py").write_text(
        f"from {name}_helpers import OFFSET\nfrom .scale import FACTOR\n\n"
        "def add(a: int) -> int:\n    return a * FACTOR + OFFSET\n"
    )
    assert resolve_callable(f"{name}.tools:add", "generation.tools")(1) == 5


def test_a_missing_module_is_one_config_error_naming_the_key(user_dir):
    _, name = user_dir
    with pytest.raises(ConfigError, match=rf"eval.gold_function: cannot import '{name}:gold'"):
        resolve_callable(f"{name}:gold", "eval.gold_function")


def test_a_module_whose_own_import_fails_is_reported_not_retried(user_dir):
    root, name = user_dir
    (root / f"{name}.py").write_text("import no_such_dependency_xyz\n\ndef f():\n    pass\n")
    with pytest.raises(ConfigError, match="no_such_dependency_xyz"):
        resolve_callable(f"{name}:f", "iterate.labeller")
