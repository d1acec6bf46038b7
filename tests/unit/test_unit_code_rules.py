"""Code rules of the package, checked on the source of every rlhf_dist module with `ast`.

- No name is defined twice at the top level of a module: the later def/class silently
  replaces the earlier one for every caller (distributed.py once had two
  `_torch_optimizer`s, and the checkpoint code read DeepSpeed's ZeRO optimizer instead of
  the AdamW inside it).
- Only the distributed layer imports accelerate or deepspeed (docs/architecture.md section 3: the
  single door), counting function-local imports and transformers' DeepSpeed integration.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE = REPO_ROOT / "rlhf_dist"
BACKENDS = {"accelerate", "deepspeed"}


def modules() -> list[tuple[str, ast.Module]]:
    """(path relative to the repo, parsed tree) of every module of the package."""
    paths = sorted(PACKAGE.rglob("*.py"))
    assert paths, f"no modules under {PACKAGE}"
    return [(str(p.relative_to(REPO_ROOT)), ast.parse(p.read_text(), str(p))) for p in paths]


def duplicate_definitions(tree: ast.Module) -> list[str]:
    """Names bound by more than one top-level def/class of the module, in order."""
    defining = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    seen, twice = set(), []
    for node in tree.body:
        if isinstance(node, defining):
            if node.name in seen and node.name not in twice:
                twice.append(node.name)
            seen.add(node.name)
    return twice


def backend_imports(tree: ast.Module) -> list[str]:
    """Imported module paths (anywhere in the module) that reach accelerate or deepspeed:
    `import deepspeed`, `from accelerate.utils import x`, `import transformers.integrations.
    deepspeed`, `from transformers.integrations import deepspeed`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [name for name in names if BACKENDS & set(name.split("."))]
    return sorted(set(found))


def in_distributed_layer(relative: str) -> bool:
    parts = Path(relative).parts
    return parts[1] == "distributed"


def test_no_module_defines_a_top_level_name_twice():
    problems = [
        f"{path}: {name}" for path, tree in modules() for name in duplicate_definitions(tree)
    ]
    assert not problems, "defined twice at the top level (the later wins):\n" + "\n".join(problems)


def test_only_the_distributed_layer_imports_accelerate_or_deepspeed():
    problems = [
        f"{path}: {name}"
        for path, tree in modules()
        if not in_distributed_layer(path)
        for name in backend_imports(tree)
    ]
    assert not problems, "imports outside rlhf_dist/distributed:\n" + "\n".join(problems)


def test_the_checks_find_what_they_look_for():
    source = """
import os, deepspeed
from transformers.integrations import deepspeed as hf_ds

def f(): pass
class C: pass
def f():
    from accelerate.utils import gather_object
class C: pass
"""
    tree = ast.parse(source)
    assert duplicate_definitions(tree) == ["f", "C"]
    assert backend_imports(tree) == [
        "accelerate.utils",
        "accelerate.utils.gather_object",
        "deepspeed",
        "transformers.integrations.deepspeed",
    ]
    assert in_distributed_layer("rlhf_dist/distributed/guard.py")
    assert not in_distributed_layer("rlhf_dist/models/")
