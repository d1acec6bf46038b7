"""Python objects handed to a run in place of files and import paths (`rlhf_dist.api`).

A notebook's `datasets.Dataset` or list of dicts, and a reward callable defined in the same
cell, have no path or `module:callable` a config could name. The API registers each one
under a spec `python:<config key>` (e.g. `python:data.train`) and sets that key to it, so the
config stays frozen text, `config.yaml` says where the value came from, and the loaders
(`data.rows.load_rows`, `rewards.scoring.RewardFunction`) resolve the spec here. Specs
live for the process; under `accelerate launch` every rank runs the same script and
registers the same objects under the same names.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

PREFIX = "python:"
LIST_KEYS = ("reward.functions",)  # config keys holding a list of specs
_objects: dict[str, object] = {}


def is_python(spec: object) -> bool:
    return isinstance(spec, str) and spec.startswith(PREFIX)


def is_model_name(spec: object) -> bool:
    """Whether a reward.functions entry names a reward model (a local path or a hub id,
    TRL's model id in reward_funcs) rather than a callable: a string without ':' (a
    callable is `module:callable` or `python:...`)."""
    return isinstance(spec, str) and bool(spec) and ":" not in spec


def lookup(spec: str, key: str) -> object:
    """The object registered under `spec`; a ConfigError naming `key` if there is none."""
    from rlhf_dist.errors import ConfigError

    if spec not in _objects:
        raise ConfigError(
            f"{key}: {spec!r} names a Python object, but none was given to this process "
            "(pass it to the rlhf_dist API function again, e.g. on resume)"
        )
    return _objects[spec]


def resolve_callable(spec: str, key: str) -> Callable[..., Any]:
    """The callable a config names: `module:callable` imported, or a `python:` spec."""
    from rlhf_dist.errors import ConfigError

    if is_python(spec):
        fn = lookup(spec, key)
    else:
        module_name, _, attr = spec.partition(":")
        try:
            fn = getattr(import_from_cwd(module_name), attr)
        except (ImportError, AttributeError, ValueError) as e:
            raise ConfigError(f"{key}: cannot import {spec!r} ({e})") from None
    if not callable(fn):
        raise ConfigError(f"{key}: {spec!r} is not callable")
    return fn


def package_spec(obj: object) -> str | None:
    """`module:name` of a top-level function of the rlhf_dist package (rlhf_dist.rewards.
    tasks:math_verify), None for anything else: what a config can name instead of a
    `python:` spec."""
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", "")
    if not (isinstance(module, str) and module.startswith("rlhf_dist.")) or "." in name:
        return None
    found = getattr(sys.modules.get(module), name, None)
    return f"{module}:{name}" if found is obj else None


def import_from_cwd(module_name: str) -> ModuleType:
    """`module_name` imported as Python would, else from the current working directory.

    `python -m rlhf_dist` puts the working directory first on sys.path, the `rlhf-dist`
    console script does not, so `reward.function: my_rewards:score` beside the user's config
    would be found by one and not the other. When the plain import cannot find the module's top
    package, the working directory goes first on sys.path for this import only (as under
    `python -m`), so the module and the siblings it imports at the top are found the way
    `python -m` finds them, packages and relative imports included (a file loader from
    the path would not give that), and nothing installed is shadowed afterwards. A module
    that is found but fails inside (a missing dependency) is not retried.
    """
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        cwd = os.getcwd()
        if e.name != module_name.split(".")[0] or cwd in sys.path:
            raise
    sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module_name)
    finally:
        sys.path.remove(cwd)


@contextlib.contextmanager
def registered(objects: dict[str, object]) -> Iterator[dict[str, str | tuple[str, ...]]]:
    """Register {config key: object} for the span of a run; yields {key: spec}. For a
    key whose value is a list (LIST_KEYS: reward.functions) the key's value is the tuple
    of its items' specs (list_specs); any other object (a dataset's list of rows
    included) is one spec, `python:<key>`."""
    specs: dict[str, str | tuple[str, ...]] = {}
    for k, v in objects.items():
        if k in LIST_KEYS and isinstance(v, list):
            specs[k] = list_specs(v)
            _objects.update((s, o) for s, o in zip(specs[k], v) if is_python(s))
        else:
            specs[k] = PREFIX + k
            _objects[PREFIX + k] = v
    try:
        yield specs
    finally:
        for spec in specs.values():
            for one in (spec,) if isinstance(spec, str) else spec:
                _objects.pop(one, None)


def list_specs(items: list) -> tuple[str, ...]:
    """The specs a list key's items stand for in the config: a string as it is (a
    `module:callable`, or a reward model's path or hub id), a top-level function of the
    package by its `module:name` (package_spec), any other object `python:<its name>`
    (its `__name__`, later duplicates suffixed _2, _3), so config.yaml names each item."""
    out: list[str] = []
    for item in items:
        spec = item if isinstance(item, str) else package_spec(item)
        if spec is None:
            name = getattr(item, "__name__", type(item).__name__)
            spec, n = PREFIX + name, 1
            while spec in out:
                n += 1
                spec = f"{PREFIX}{name}_{n}"
        out.append(spec)
    return tuple(out)


def accepted_columns(fn: Callable[..., Any], columns: dict, taken: tuple[str, ...] = ()) -> dict:
    """The entries of `columns` (a row's or a batch's other columns, by name) that `fn`
    takes: all of them when it has **kwargs, else those it names as parameters; never the
    names in `taken` (the arguments the caller passes itself). Users' functions declare
    the columns they read (`def reward(prompts, completions, answer, **kw)`, TRL's
    convention), and a function that declares none is called as before."""
    params = _parameters(fn)
    if params is None:  # no signature to read (a builtin): no extra columns
        return {}
    names, any_keyword = params
    return {k: v for k, v in columns.items() if k not in taken and (any_keyword or k in names)}


def required_parameters(fn: Callable[..., Any], skip: int = 0) -> list[str]:
    """The parameters of `fn` without a default value, after its first `skip` positional
    ones (the arguments the caller always passes): the columns it cannot do without."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    plain = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    params = [p for p in sig.parameters.values() if p.kind in plain]
    positional = [p for p in params if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD]
    skipped = {p.name for p in positional[:skip]}
    return [p.name for p in params if p.default is p.empty and p.name not in skipped]


def parameter_names(fn: Callable[..., Any]) -> set[str]:
    """The names `fn` takes by keyword (none when its signature cannot be read)."""
    params = _parameters(fn)
    return set() if params is None else params[0]


def _parameters(fn: Callable[..., Any]) -> tuple[set[str], bool] | None:
    """(the names `fn` takes by keyword, whether it takes **kwargs), or None when its
    signature cannot be read."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names = {p.name for p in sig.parameters.values() if p.kind in keyword}
    var = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
    return names, var


def column_lists(rows: list[dict]) -> dict[str, list]:
    """Per-row columns as one list per column name, as TRL hands them to a reward
    function: {name: [value of row 0, value of row 1, ...]}, None where a row lacks it."""
    names = dict.fromkeys(name for row in rows for name in row)
    return {name: [row.get(name) for row in rows] for name in names}
