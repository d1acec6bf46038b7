"""Every dotted name `rlhf_dist.X[.Y...]` that the docs (README.md, docs/*.md) and the
package's docstrings and comments mention resolves: to a module, or to an attribute of one
(the longest importable module prefix, then getattr for the rest; a dataclass field or an
annotated class attribute counts). A moved or renamed module or function then fails here,
with every stale name as file:line, instead of sending a reader to a name that is gone.

Paths (`rlhf_dist/...`) are not dotted names; `rlhf_dist.trainers.*` is read as
`rlhf_dist.trainers`; `rlhf_dist.demo.task:gold_reward_fn` as its module part.
"""

import ast
import importlib
import importlib.util
import io
import re
import tokenize
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"(?<![\w/.-])rlhf_dist(?:\.[A-Za-z_]\w*)+")


def docstring_lines(source: str) -> set[int]:
    """Line numbers of the module's, classes' and functions' docstrings."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            value = first.value if isinstance(first, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def python_mentions(path: Path):
    """(line, name) of each dotted name in a docstring or a comment of `path`."""
    source = path.read_text(encoding="utf-8")
    docs = docstring_lines(source)
    text = source.splitlines()
    for number in sorted(docs):
        for m in NAME.finditer(text[number - 1]):
            yield number, m.group(0)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            for m in NAME.finditer(tok.string):
                yield tok.start[0], m.group(0)


def text_mentions(path: Path):
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        for m in NAME.finditer(line):
            yield number, m.group(0)


def has_attribute(obj, name: str) -> tuple[bool, object]:
    if hasattr(obj, name):
        return True, getattr(obj, name)
    fields = getattr(obj, "__dataclass_fields__", {})
    annotations = getattr(obj, "__annotations__", {}) if isinstance(obj, type) else {}
    return name in fields or name in annotations, None


@cache
def resolves(name: str) -> bool:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            spec = importlib.util.find_spec(module_name)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            continue
        try:
            obj = importlib.import_module(module_name)
        except ImportError:  # an optional dependency missing here: the module exists
            return top_level_defines(spec.origin, parts[cut:])
        for attr in parts[cut:]:
            found, obj = has_attribute(obj, attr)
            if not found:
                return False
            if obj is None:  # a field or an annotation: nothing deeper to check
                return True
        return True
    return False


def top_level_defines(origin: str | None, rest: list[str]) -> bool:
    """Without importing: does the module's source define rest[0] at its top level?"""
    if not rest:
        return True
    if origin is None:
        return False
    tree = ast.parse(Path(origin).read_text(encoding="utf-8"))
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return rest[0] in names


def mentions():
    for path in sorted((ROOT / "rlhf_dist").rglob("*.py")):
        for line, name in python_mentions(path):
            yield path, line, name
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for line, name in text_mentions(path):
            yield path, line, name


def test_every_dotted_name_in_the_docs_resolves():
    seen = list(mentions())
    assert len(seen) > 50  # the scan finds the names at all
    stale = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path, line, name in seen
        if not resolves(name)
    ]
    assert not stale, f"{len(stale)} dotted names do not resolve:\n" + "\n".join(stale)
