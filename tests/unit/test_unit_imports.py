"""Shared pieces live outside the trainers: only the entry points that run a stage import
rlhf_dist.trainers (read from the source with ast, so no module is imported here)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "rlhf_dist"
# Entry points that run a stage: the CLI, the demo pipeline, and iterate (which chains the
# RM and PPO runners and scores with the RM trainer's held-out evaluation).
STAGE_RUNNERS = {
    "cli.py",
    "demo/pipeline.py",
    "iterative.py",
    "demo/iterative.py",
    "demo/tool_demo.py",
    "demo/arithmetic_demo.py",
}


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, at any depth (lazy imports inside functions too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def imports_a_trainer(path: Path) -> bool:
    return any(n.startswith("rlhf_dist.trainers") for n in imported_modules(path))


def test_evaluate_imports_no_trainer_module():
    assert not imports_a_trainer(PACKAGE / "evaluate.py"), sorted(
        imported_modules(PACKAGE / "evaluate.py")
    )


@pytest.mark.parametrize(
    "path",
    sorted(
        p
        for p in PACKAGE.rglob("*.py")
        if "trainers" not in p.relative_to(PACKAGE).parts
        and p.relative_to(PACKAGE).as_posix() not in STAGE_RUNNERS
    ),
    ids=lambda p: p.relative_to(PACKAGE).as_posix(),
)
def test_library_modules_import_no_trainer(path):
    assert not imports_a_trainer(path)


def test_the_check_sees_a_trainer_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from rlhf_dist.trainers import ppo\n", encoding="utf-8")
    assert imports_a_trainer(module)
