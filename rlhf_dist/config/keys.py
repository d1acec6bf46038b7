"""Declaring a config key: `key(default, help, choices=..., min=/max=/gt=/lt=, needs=,
estimators=)`, and the range checks `validate` and `rlhf-dist config` share."""

from __future__ import annotations

import math
from dataclasses import field
from typing import Any

from rlhf_dist.errors import ConfigError, RewardFunctionError, UserError  # noqa: F401 (re-exported)

BOUNDS = ("min", "max", "gt", "lt")  # >= min, <= max, > gt, < lt
# `needs=`: the estimator trait (algo/catalog.py EstimatorTraits, needs_<name>) without
# which ppo.estimator does not read the key (config/views.py)
NEEDS = ("critic", "groups")


def key(
    default: Any,
    help: str,
    choices: tuple[str, ...] = (),
    *,
    finite: bool = False,
    needs: str = "",
    estimators: tuple[str, ...] = (),
    **bounds: float,
) -> Any:
    """A config key: its default, its meaning (what `rlhf-dist config` prints), and what
    `validate` enforces on its value: `choices` for text keys (and each item of a list
    key) with a fixed set of values; a range, `min`/`max` (inclusive) and `gt`/`lt`
    (exclusive), on numbers (and each item of a list key; null passes where the key is
    optional); `finite` alone refuses NaN and inf (any bound implies it). Who reads it,
    where only some PPO estimators do: `needs="critic"` (only an estimator with that
    trait, algo/catalog.py) and/or `estimators=(names)` (only those); a key with either
    is read by the PPO loop alone (`config/views.py`: the starter file and `rlhf-dist
    config PRESET` leave it out where the estimator does not read it). Every key is
    declared with this, so its documentation, range and readers cannot drift away from it."""
    unknown = set(bounds) - set(BOUNDS)
    if unknown:
        raise TypeError(f"key(): unknown bound {sorted(unknown)} (one of {BOUNDS})")
    if needs and needs not in NEEDS:
        raise TypeError(f"key(): needs={needs!r} (one of {NEEDS})")
    meta: dict[str, Any] = {"help": help}
    if needs:
        meta["needs"] = needs
    if estimators:
        meta["estimators"] = tuple(estimators)
    if choices:
        meta["choices"] = tuple(choices)
    if bounds or finite:
        meta["range"] = dict(bounds)
    return field(default=default, metadata=meta)


def range_text(bounds: dict[str, float]) -> str:
    """`{"gt": 0}` -> "> 0", `{"min": 0, "max": 1}` -> "in [0, 1]", `{}` -> "finite"."""
    low = ("[", bounds["min"]) if "min" in bounds else ("(", bounds.get("gt"))
    high = ("]", bounds["max"]) if "max" in bounds else (")", bounds.get("lt"))
    if low[1] is not None and high[1] is not None:
        return f"in {low[0]}{low[1]:g}, {high[1]:g}{high[0]}"
    if low[1] is not None:
        return f"{'>=' if low[0] == '[' else '>'} {low[1]:g}"
    if high[1] is not None:
        return f"{'<=' if high[0] == ']' else '<'} {high[1]:g}"
    return "finite"


def in_range(value: float, bounds: dict[str, float]) -> bool:
    """Whether `value` is finite and within `bounds` (key's min/max/gt/lt); NaN never is."""
    if not math.isfinite(value):
        return False
    return not (
        ("min" in bounds and value < bounds["min"])
        or ("max" in bounds and value > bounds["max"])
        or ("gt" in bounds and value <= bounds["gt"])
        or ("lt" in bounds and value >= bounds["lt"])
    )
