"""The roofline arithmetic of launch/bench/harness.py (the TRL side-by-side's floor per
phase) on a model small enough to count by hand, and the peak measurement's speed."""

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "launch/bench"))
import harness  # noqa: E402

# 1000 body weights, a 200-weight LM head, 2 layers of hidden 8, keys 4 wide per token.
SHAPES = {"body": 1000, "lm_head": 200, "layers": 2, "hidden": 8, "kv": 4}


def test_forward_flops_by_hand():
    # 5 tokens, LM head on 2: 2*1000*5 + 2*200*2 + attention 4*8*2 * 5*5/2 = 10000 + 800 + 800
    assert harness.forward_flops(SHAPES, 5, 2) == 11_600


def test_phase_work_by_hand():
    rows, prompt, new = 2, 3, 2
    # Generation: 2 rows x 11,600 FLOPs. Bytes: fp32 weights (1200 x 4) read 1 + 2 times,
    # plus the cache: 2 rows x (k, v) x 2 layers x 4 wide x 4 bytes x (2*3 + 2*1/2) tokens.
    assert harness.generation_work(SHAPES, rows, prompt, new) == (23_200, 3 * 4800 + 896)
    # Scoring: one forward of the same model: the weights read once.
    assert harness.scoring_work([(SHAPES, new)], rows, prompt + new) == (23_200, 4800)
    # Update, one epoch in one optimizer step: 3 forwards' FLOPs; weights read twice and
    # gradients written (3 x 4800) plus AdamW's 7 fp32 reads and writes per weight (7 x 4800).
    assert harness.update_work([(SHAPES, new)], rows, prompt + new, 1, 1) == (69_600, 48_000)
    # Two epochs in 4 steps: twice the FLOPs, four times the optimizer's traffic.
    assert harness.update_work([(SHAPES, new)], rows, prompt + new, 2, 4) == (139_200, 192_000)
    # bf16 weights halve the weight and cache bytes of generation, not its FLOPs.
    assert harness.generation_work(SHAPES, rows, prompt, new, 2) == (23_200, 3 * 2400 + 448)


def test_roofline_is_the_larger_bound():
    # 69,600 FLOPs at 1000 FLOP/s: 69.6 s; 48,000 bytes at 100 B/s: 480 s -> memory-bound.
    assert harness.roofline(69_600, 48_000, 1000, 100) == pytest.approx(480)
    assert harness.roofline(69_600, 48_000, 100, 1000) == pytest.approx(696)
    lines = harness.roofline_lines({"update": (69_600, 48_000)}, (1000, 100), {"update": 960.0})
    assert "memory" in lines[-1] and "2.0x" in lines[-1]


def test_peaks_are_measured_in_seconds():
    start = time.perf_counter()
    flops, bandwidth = harness.measure_peaks(seconds=0.05)
    assert flops > 1e8 and bandwidth > 1e8
    assert time.perf_counter() - start < 30
