"""Building a Config: YAML safe-loaded, `section.key=value` overrides, renamed keys
accepted for one release with a deprecation line, types coerced and checked, and the
help text of `rlhf-dist config`."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import textwrap
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from rlhf_dist.config.keys import in_range, range_text
from rlhf_dist.config.presets import preset_tree
from rlhf_dist.config.schema import Config
from rlhf_dist.errors import ConfigError, RewardFunctionError, UserError  # noqa: F401 (re-exported)
from rlhf_dist.files import atomic_write_text


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_optional(tp: Any) -> tuple[bool, Any]:
    """(True, inner) for `X | None`; (False, tp) otherwise."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return True, args[0]
    return False, tp


def parse_scalar(text: str) -> Any:
    """A command-line value as YAML would read it (`1`, `true`, `null`, `[a, b]`, text)."""
    try:
        return yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return text


def spec_options(query: str, value: str, key: str, form: str) -> dict[str, Any]:
    """The `name=value&name=value` part of a spec (`reasoning_gym:`, `verifiers:`), values
    read as parse_scalar reads them; a ConfigError naming `key` for a malformed or repeated
    pair (`value` the whole spec, `form` its expected shape)."""
    given: dict[str, Any] = {}
    for part in query.split("&") if query else []:
        name, eq, text = part.partition("=")
        if not eq or not name.isidentifier():
            raise ConfigError(f"{key}: {part!r} in {value!r} is not key=value ({form})")
        if name in given:
            raise ConfigError(f"{key}: {name} is given twice in {value!r}")
        given[name] = parse_scalar(text)
    return given


def is_int(v: Any) -> bool:
    """An int that is not a bool (YAML reads `true` as a bool, which Python counts as an int)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    optional, inner = _is_optional(tp)
    if value is None or (optional and isinstance(value, str) and value.lower() in ("null", "none")):
        if optional:
            return None
        raise ConfigError(f"{key}: must not be null")
    if inner is bool:
        if isinstance(value, bool):
            return value
    elif inner is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif inner is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-5" as text
            try:
                return float(value)
            except ValueError:
                pass
    elif inner is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    elif typing.get_origin(inner) is tuple:
        item = typing.get_args(inner)[0]
        items = [value] if isinstance(value, (str, int)) else value
        if (
            item is str
            and isinstance(items, (list, tuple))
            and all(isinstance(v, str) for v in items)
        ):
            return tuple(v for v in items if v)
        if item is int and isinstance(items, (list, tuple)) and all(is_int(v) for v in items):
            return tuple(items)
        if item is float and isinstance(items, (list, tuple, int, float)):
            items = [items] if isinstance(items, (int, float)) else items
            if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in items):
                return tuple(float(v) for v in items)
    name = getattr(inner, "__name__", str(inner))
    raise ConfigError(f"{key}: expected {name}, got {value!r} ({type(value).__name__})")


def _check_choices(name: str, f: dataclasses.Field, value: Any) -> None:
    """A key declared with `choices`: its value (each item of a list key) is one of them."""
    choices = f.metadata.get("choices")
    if not choices:
        return
    items = value if isinstance(value, tuple) else (value,)
    bad = [v for v in items if v not in choices]
    if bad:
        raise ConfigError(f"{name}: must be one of {', '.join(choices)}, got {bad[0]!r}")


def _check_range(name: str, f: dataclasses.Field, value: Any) -> None:
    """A key declared with a range: its value (each item of a list key) lies in it; null
    passes (only optional keys can hold it)."""
    bounds = f.metadata.get("range")
    if bounds is None or value is None:
        return
    if isinstance(value, tuple):
        if not all(in_range(v, bounds) for v in value):
            raise ConfigError(f"{name}: each must be {range_text(bounds)}, got {list(value)}")
    elif not in_range(value, bounds):
        null = " or null" if f.default is None else ""
        raise ConfigError(f"{name}: must be {range_text(bounds)}{null}, got {value}")


def check_keys(cfg: Config) -> None:
    """Every key's declared choices and range (key(...)), in every section."""
    for name, f, _, value in _walk(cfg):
        if not dataclasses.is_dataclass(value):
            _check_choices(name, f, value)
            _check_range(name, f, value)


def _build(cls: type, data: dict, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {data!r}")
    hints = _hints(cls)
    names = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in names:
            known = ", ".join(sorted(names))
            raise ConfigError(f"{full}: unknown key (known here: {known})")
        tp = hints[key]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):  # a section
            default = names[key].default
            if dataclasses.is_dataclass(default) and not isinstance(default, type):
                base = dataclasses.asdict(default)
            else:
                base = {}
            kwargs[key] = _build(tp, deep_merge(base, value, full), f"{full}.")
        else:
            kwargs[key] = _coerce(value, tp, full)
            if not isinstance(kwargs[key], tuple):  # list keys: in validate, with the ranges
                _check_choices(full, names[key], kwargs[key])
    return cls(**kwargs)


def deep_merge(base: dict, extra: Any, key: str) -> dict:
    if not isinstance(extra, dict):
        raise ConfigError(f"{key}: expected a mapping, got {extra!r}")
    out = dict(base)
    for k, v in extra.items():
        out[k] = deep_merge(out[k], v, f"{key}.{k}") if isinstance(out.get(k), dict) else v
    return out


def apply_override(tree: dict, override: str) -> dict:
    """Return a copy of `tree` with one `a.b.c=value` override applied."""
    if "=" not in override:
        raise ConfigError(f"{override}: overrides look like section.key=value")
    dotted, text = override.split("=", 1)
    parts = dotted.strip().split(".")
    if not all(parts):
        raise ConfigError(f"{dotted}: overrides look like section.key=value")
    out = dict(tree)
    node = out
    for part in parts[:-1]:
        child = node.get(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: {part} is not a section")
        node[part] = dict(child)
        node = node[part]
    node[parts[-1]] = parse_scalar(text)
    return out


def load_config(
    path: str | os.PathLike | None = None, overrides: Sequence[str] = (), preset: str | None = None
) -> Config:
    """Config from a preset (config/presets.py), then a YAML file (safe-loaded), then
    `section.key=value` overrides, each over the one before."""
    tree = deep_merge(preset_tree(preset), read_tree(path), "config")
    for override in overrides:
        tree = apply_override(tree, override)
    return config_from_dict(tree)


def read_tree(path: str | os.PathLike | None) -> dict:
    """The nested dict of a YAML config file (safe-loaded; None: empty); a file that cannot
    be read or is not a mapping of sections is a ConfigError."""
    tree: dict = {}
    if path:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"--config {path}: cannot read ({e.strerror})") from None
        except UnicodeDecodeError:
            raise ConfigError(f"--config {path}: cannot read (not UTF-8 text)") from None
        try:
            tree = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            where = getattr(e, "problem_mark", None)
            line = f" at line {where.line + 1}" if where else ""
            raise ConfigError(f"--config {path}: invalid YAML{line}") from None
        if not isinstance(tree, dict):
            raise ConfigError(
                f"--config {path}: expected a mapping of sections, got {type(tree).__name__}"
            )
    return tree


# Keys renamed in this release (old dotted name -> new): still accepted, with one line on
# stderr naming the new key; to be removed in the next release.
RENAMED_KEYS = {
    "ppo.actor": "ppo.optim",
    "ppo.critic": "ppo.critic_optim",
    "run.num_threads": "perf.num_threads",
    "run.retain_host_memory": "perf.retain_host_memory",
    "model.logprob_chunk_tokens": "perf.logprob_chunk_tokens",
    "model.packed_sequences": "perf.packed_sequences",
    "model.shared_prompt_forward": "perf.shared_prompt_forward",
    "distributed.gather_for_generation": "perf.gather_for_generation",
    "distributed.gather_for_training": "perf.gather_for_training",
}


def config_from_dict(tree: dict) -> Config:
    return _build(Config, renamed_keys(tree), "")


def _moved_tis_cap(tree: dict) -> dict:
    """`tree` with ppo.tis_cap: C (this release: ppo.rollout_correction=tis at the token
    level, ppo.rollout_correction_high=C) moved to those keys, said once on stderr; null
    means off, as it did. Setting both spellings is a ConfigError."""
    found, cap = _pop_dotted(tree, "ppo.tis_cap")
    if not found:
        return tree
    out = _without(tree, "ppo.tis_cap")
    if cap is None:
        return out
    if isinstance(cap, bool) or not isinstance(cap, int | float) or not cap > 0:
        raise ConfigError(f"ppo.tis_cap: must be > 0 or null, got {cap!r}")
    new = ("ppo.rollout_correction", "ppo.rollout_correction_level", "ppo.rollout_correction_high")
    if any(_pop_dotted(out, name)[0] for name in new):
        raise ConfigError("ppo.tis_cap: replaced by ppo.rollout_correction=tis; set only those")
    out = apply_value(out, new[0], "tis")
    out = apply_value(out, new[2], cap)
    if os.environ.get("RANK", "0") == "0":
        print(f"config: ppo.tis_cap is now ppo.rollout_correction=tis with "
              f"ppo.rollout_correction_high={cap:g} (the old name goes in the next release)",
              file=sys.stderr, flush=True)  # fmt: skip
    return out


def renamed_keys(tree: dict) -> dict:
    """`tree` with every key of RENAMED_KEYS moved to its new name, said once on stderr
    (by the main process); the old and the new name both set is a ConfigError."""
    out = _moved_tis_cap(tree)
    for old, new in RENAMED_KEYS.items():
        found, value = _pop_dotted(out, old)
        if not found:
            continue
        if _pop_dotted(out, new)[0]:
            raise ConfigError(f"{old}: renamed to {new}; set only {new}")
        out = apply_value(out, new, value)
        if os.environ.get("RANK", "0") == "0":
            star = ".*" if isinstance(value, dict) else ""
            print(f"config: {old}{star} is renamed {new}{star} (the old name goes in the next "
                  "release)", file=sys.stderr, flush=True)  # fmt: skip
    return out


def _pop_dotted(tree: dict, dotted: str) -> tuple[bool, Any]:
    """(whether `dotted` is set in `tree`, its value); `tree` is left unchanged."""
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def apply_value(tree: dict, dotted: str, value: Any) -> dict:
    """A copy of `tree` without `dotted`'s old place (if it was a renamed key) and with
    `value` at `dotted`; sections on the way are copied, never modified."""
    old = next((o for o, n in RENAMED_KEYS.items() if n == dotted), None)
    out = _without(tree, old) if old else dict(tree)
    node, parts = out, dotted.split(".")
    for part in parts[:-1]:
        node[part] = dict(node.get(part) or {})
        node = node[part]
    node[parts[-1]] = value
    return out


def _without(tree: dict, dotted: str) -> dict:
    """A copy of `tree` without the key `dotted` (sections on the way copied)."""
    head, _, rest = dotted.partition(".")
    if head not in tree:
        return dict(tree)
    out = dict(tree)
    if rest and isinstance(out[head], dict):
        out[head] = _without(out[head], rest)
    elif not rest:
        del out[head]
    return out


def to_dict(cfg: Any) -> dict:
    """Plain nested dict (tuples become lists) for YAML/JSON output."""

    def plain(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v

    return plain(dataclasses.asdict(cfg))


def save_config(cfg: Config, output_dir: str | os.PathLike) -> Path:
    """Write the effective config to `<output_dir>/config.yaml` (atomically) and return its path."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(out / "config.yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False))


def _type_name(tp: Any) -> str:
    optional, inner = _is_optional(tp)
    if typing.get_origin(inner) is tuple:
        name = f"list of {typing.get_args(inner)[0].__name__}"
    else:
        name = inner.__name__
    return f"{name} or null" if optional else name


def _walk(section: Any, prefix: str = "") -> list[tuple[str, dataclasses.Field, Any, Any]]:
    """(dotted name, field, type, default) of every key and subsection under `section` (an
    instance, so nested defaults such as sft.optim.lr are the section's own), in order."""
    hints, out = _hints(type(section)), []
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        out.append((f"{prefix}{f.name}", f, hints[f.name], value))
        if dataclasses.is_dataclass(value):
            out += _walk(value, f"{prefix}{f.name}.")
    return out


def describe(
    section: str = "", cfg: Config | None = None, keep: Callable[[str], bool] | None = None
) -> str:
    """Every key under `section` ("" = all; "ppo", "ppo.optim" or one key; a renamed key
    by its new name) with its type, default, choices or range, and meaning: the text of
    `rlhf-dist config [SECTION]`. `cfg`: whose values are shown as defaults (a preset's;
    None: Config()); `keep`: which dotted keys to show (config/views.py; None: all)."""
    for old, new in RENAMED_KEYS.items():
        if f"{section}.".startswith(f"{old}."):
            section = new + section[len(old) :]
    entries = [
        e
        for e in _walk(cfg or Config())
        if (not section or f"{e[0]}.".startswith(f"{section}.")) and (keep is None or keep(e[0]))
    ]
    if not entries:
        known = ", ".join(f.name for f in dataclasses.fields(Config))
        raise ConfigError(f"{section}: no such section or key (sections: {known})")
    lines: list[str] = []
    for name, f, tp, value in entries:
        text = f.metadata.get("help", "")
        if dataclasses.is_dataclass(value):
            lines += ([""] if "." not in name and lines else []) + [f"{name}: {text}"]
            continue
        default = json.dumps(list(value) if isinstance(value, tuple) else value)
        choices, bounds = f.metadata.get("choices"), f.metadata.get("range")
        head = f"  {name}  {_type_name(tp)} = {default}"
        head += f"  (one of: {', '.join(choices)})" if choices else ""
        if bounds is not None:
            each = "each " if typing.get_origin(_is_optional(tp)[1]) is tuple else ""
            null = " or null" if f.default is None else ""
            head += f"  ({each}{range_text(bounds)}{null})"
        lines += [
            head,
            textwrap.fill(
                text, 100, initial_indent=" " * 6, subsequent_indent=" " * 6, break_on_hyphens=False
            ),
        ]
    return "\n".join(lines)
