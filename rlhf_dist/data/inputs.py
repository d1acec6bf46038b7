"""Python objects handed to a run in place of files and import paths (`rlhf_dist.api`).

A notebook's `datasets.Dataset` or list of dicts, and a reward callable defined in the same
cell, have no path or `module:callable` a config could name. The API registers each one
under a spec `python:<config key>` (e.g. `python:data.train`) and sets that key to it, so the
config stays frozen text, `config.yaml` says where the value came from, and the loaders
(`data.load_rows`, `scoring.RewardFunction`) resolve the spec here. Specs live for the
process; under `accelerate launch` every rank runs the same script and registers the same
objects under the same names.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys

PREFIX = "python:"
_objects: dict[str, object] = {}


def is_python(spec: object) -> bool:
    return isinstance(spec, str) and spec.startswith(PREFIX)


def lookup(spec: str, key: str) -> object:
    """The object registered under `spec`; a ConfigError naming `key` if there is none."""
    from rlhf_dist.errors import ConfigError

    if spec not in _objects:
        raise ConfigError(
            f"{key}: {spec!r} names a Python object, but none was given to this process "
            "(pass it to the rlhf_dist API function again, e.g. on resume)"
        )
    return _objects[spec]


def resolve_callable(spec: str, key: str):
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


def import_from_cwd(module_name: str):
    """`module_name` imported as Python would, else from the current working directory.

    `python -m rlhf_dist` puts the working directory first on sys.path, the `rlhf-dist`
    console script does not, so `reward.function: my_rewards:score` beside the user's config
    was found by one and not the other. When the plain import cannot find the module's top
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
def registered(objects: dict[str, object]):
    """Register {config key: object} for the span of a run; yields {key: spec}."""
    specs = {k: PREFIX + k for k in objects}
    _objects.update({specs[k]: v for k, v in objects.items()})
    try:
        yield specs
    finally:
        for spec in specs.values():
            _objects.pop(spec, None)
