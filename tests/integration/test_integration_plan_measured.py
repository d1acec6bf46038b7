"""The memory plan against the measured peak on one small cell of
launch/bench/memory.py plan's grid (docs/benchmarks.md holds the whole grid): a random
Llama, 8 sequences of 16 + 32 tokens, plain and gradient checkpointing, each phase's
planned peak within 15% of the tensors' measured peak (the profiler's allocation
records)."""

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "launch/bench"


@pytest.mark.parametrize("variant", ["plain", "checkpointing"])
def test_plan_is_within_15_percent_of_the_measured_peak(variant, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import memory as plan_check

    monkeypatch.setitem(plan_check.SIZES, "XS", (64, 2, 4, 2, 176, 2048))
    path = plan_check.build_model("XS", "sdpa", tmp_path)
    plan = plan_check.planned(path, 16, 32, variant, "sdpa")
    measured = plan_check.measure(path, 16, 32, variant)
    for phase in plan_check.PHASES:
        assert plan[phase] == pytest.approx(measured[phase], rel=0.15), phase
    sys.modules.pop("memory", None)
