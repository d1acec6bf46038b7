"""What the benchmarks in launch/bench share: round reading and medians, model shapes and
FLOP counts, the roofline floor per phase with this machine's measured peaks, the GRPO
benchmark's reward and the rollout server the async and memory benchmarks start.

Importable from every venv a benchmark runs in (the project's and TRL's): nothing here
imports torch, transformers or rlhf_dist at module level.

The entry points (docs/benchmarks.md has one table per benchmark):
  vs_trl.sh TASK       rlhf_dist against TRL (ppo, grpo, arithmetic, preference, loss-check,
                       profile); vs_trl_ours.py and vs_trl_trl.py are its two sides
  memory.py CHECK      memory: plan, plan-zero3, vocab, sp, sync
  async_tail.sh MODE   rollouts served ahead: tail (default), overlap, demo, serve; and
                       routing, MoE routing replay against a bf16 server (docs/moe.md)
  gpu_suite.sh         one GPU loan: the PPO cases, GRPO vs TRL, async, plan
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# --------------------------------------------------------------------------- rounds


def median_spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} s (min {min(xs):.3f}, max {max(xs):.3f}, n={len(xs)})"


def read_rounds(
    results: Path, warmup: int, skip: set[str]
) -> tuple[list[list[float]], list[list[float]], dict]:
    """Per-round iteration seconds of ours and TRL, and ours' phase times (pooled)."""
    ours, trl, phases = [], [], {"time/generate": [], "time/score": [], "time/update": []}
    for rnd in sorted(results.glob("round*")):
        if rnd.name.removeprefix("round") in skip:
            continue
        metrics = rnd / "ours" / "metrics.jsonl"
        if metrics.exists():
            rows = [json.loads(line) for line in metrics.read_text(encoding="utf-8").splitlines()]
            rows = [r for r in rows if "time/total" in r][warmup:]
            ours.append([r["time/total"] for r in rows])
            for k in phases:
                phases[k] += [r[k] for r in rows]
        trl_json = rnd / "trl.json"
        if trl_json.exists():
            trl.append(json.loads(trl_json.read_text(encoding="utf-8"))["seconds"][warmup:])
    return ours, trl, phases


# --------------------------------------------------------------------------- FLOPs


def matmul_rate(m: int, k: int, n: int, seconds: float = 1.0, dtype=None) -> float:
    """Measured FLOP/s of (m, k) @ (k, n) on this machine: the fastest of repeated runs,
    since a floor wants the best rate the machine reaches, not one disturbed by others."""
    import torch

    dtype = dtype or torch.float32
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    for _ in range(3):
        a @ b
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 5:
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return 2 * m * k * n / min(times)


def model_shapes(path: Path) -> dict:
    """Matmul parameter counts of a saved Llama: body (per token), lm_head, layers, hidden,
    intermediate, vocabulary and kv (the width of one token's keys, = its values')."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(str(path))
    d, f, layers = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    kv = d // c.num_attention_heads * c.num_key_value_heads
    per_layer = d * d * 2 + d * kv * 2 + 3 * d * f  # q, o, k, v projections; gate, up, down
    return {
        "body": layers * per_layer,
        "lm_head": d * c.vocab_size,
        "layers": layers,
        "hidden": d,
        "intermediate": f,
        "vocab": c.vocab_size,
        "kv": kv,
    }


def forward_flops(s: dict, length: float, head_tokens: float) -> float:
    """FLOPs of one causal forward over `length` tokens with the LM head on `head_tokens`.

    2 FLOPs per weight per token for the projections, plus attention scores and the
    weighted sum: 2 * 2 * d per (query, key) pair, length^2 / 2 pairs under the causal mask.
    """
    attention = 4 * s["hidden"] * s["layers"] * length * length / 2
    return 2 * s["body"] * length + 2 * s["lm_head"] * head_tokens + attention


# --------------------------------------------------------------------------- roofline
# A phase cannot finish faster than max(FLOPs / peak FLOP/s, bytes moved / peak bandwidth):
# the roofline floor. The counts below are the least work each phase must do:
#   N = matmul weights of a model (body + LM head; the embedding lookup reads only rows),
#   W = N * bytes per weight, L = prompt P + new tokens T, rows = sequences of the batch.
# generation  FLOPs: rows * forward_flops(L tokens, LM head on T)   (~2N per token + attention)
#             bytes: (T + 1) * W  (weights read once for the prefill and once per decode step,
#                    shared by all rows) + rows * 2 * layers * kv * b * (T * P + T(T - 1) / 2)
#                    (each decode step reads the keys and values of every earlier token)
# scoring     per forward pass of a model: FLOPs rows * forward_flops(L, head tokens)
#             (~2N per token); bytes W (weights read once: one micro-batch of all rows)
# update      FLOPs: 3 * rows * forward_flops(L, head tokens) per epoch (forward +
#             backward = ~6N per token); bytes per optimizer step: 3 W (weights read in the
#             forward and the backward, gradients written) + 7 N * 4 (AdamW in fp32 reads
#             weight, gradient and two moments and writes weight and two moments)


def generation_work(s: dict, rows: int, prompt: float, new: int, weight_bytes: int = 4):
    """(FLOPs, bytes) of sampling `new` tokens for `rows` prompts of `prompt` tokens."""
    flops = rows * forward_flops(s, prompt + new, new)
    weights = (s["body"] + s["lm_head"]) * weight_bytes
    kv_per_token = 2 * s["layers"] * s["kv"] * weight_bytes
    cache = rows * kv_per_token * (new * prompt + new * (new - 1) / 2)
    return flops, (new + 1) * weights + cache


def scoring_work(passes: list[tuple[dict, float]], rows: int, length: float, weight_bytes: int = 4):
    """(FLOPs, bytes) of one forward per (model shapes, LM-head tokens) in `passes`."""
    flops = sum(rows * forward_flops(s, length, head) for s, head in passes)
    return flops, sum((s["body"] + s["lm_head"]) * weight_bytes for s, _ in passes)


def update_work(
    models: list[tuple[dict, float]], rows: int, length: float, epochs: int, steps: int,
    weight_bytes: int = 4,
):  # fmt: skip
    """(FLOPs, bytes) of `epochs` passes over `rows` sequences in `steps` optimizer steps
    of each trained (model shapes, LM-head tokens) in `models`."""
    flops = sum(epochs * 3 * rows * forward_flops(s, length, head) for s, head in models)
    params = sum(s["body"] + s["lm_head"] for s, _ in models)
    return flops, steps * (3 * params * weight_bytes + 7 * params * 4)


def roofline(flops: float, moved: float, peak_flops: float, peak_bytes: float) -> float:
    """Seconds a phase needs at least: its compute or its memory traffic, the larger."""
    return max(flops / peak_flops, moved / peak_bytes)


def measure_peaks(dtype=None, seconds: float = 0.5) -> tuple[float, float]:
    """This machine's peak FLOP/s (a large square matmul) and memory bandwidth in bytes/s
    (a 256 MiB tensor copied: read once, written once), the fastest of repeated runs; on
    the GPU when there is one. A few seconds at most."""
    import torch

    dtype = dtype or torch.float32
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def fastest(fn) -> float:
        fn()
        sync()
        times: list[float] = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end or len(times) < 3:
            t = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t)
        return min(times)

    n = 8192 if device == "cuda" else 2048
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    flops = 2 * n**3 / fastest(lambda: a @ b)
    src = torch.ones(64 << 20, dtype=torch.float32, device=device)  # 256 MiB
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() * 4 / fastest(lambda: dst.copy_(src))
    return flops, bandwidth


def roofline_lines(work: dict, peaks: tuple[float, float], measured: dict) -> list[str]:
    """The roofline table: per phase its FLOPs, bytes, floor and the measured median
    seconds (`measured[phase]`, where there is one) over the floor."""
    peak_flops, peak_bytes = peaks
    lines = [
        f"== Roofline floor per phase (measured peaks: {peak_flops / 1e9:.1f} GFLOP/s, "
        f"{peak_bytes / 1e9:.1f} GB/s)",
        f"   {'phase':10s} {'FLOPs':>9s} {'bytes':>9s} {'floor s':>9s} {'bound':>7s} "
        f"{'ours s':>8s} {'ours/floor':>10s}",
    ]
    for phase, (flops, moved) in work.items():
        floor = roofline(flops, moved, peak_flops, peak_bytes)
        bound = "compute" if flops / peak_flops >= moved / peak_bytes else "memory"
        ours = measured.get(phase)
        tail = f"{ours:8.3f} {ours / floor:9.1f}x" if ours else f"{'-':>8s} {'-':>10s}"
        lines.append(f"   {phase:10s} {flops:9.3g} {moved:9.3g} {floor:9.4f} {bound:>7s} {tail}")
    return lines


# --------------------------------------------------------------------------- GRPO reward
# The GRPO benchmark's reward (ours: reward.function=harness:reward with launch/bench on the
# path; TRL: trl_reward): the share of a response's words that also appear in the prompt.
# Cheap, deterministic and different between samples, so every GRPO group has a spread.


def _text(x) -> str:
    """A plain text, a message list (the last message's content) or a TRL completion."""
    if isinstance(x, list):
        return str(x[-1]["content"]) if x else ""
    return str(x)


def copy_share(prompt, response) -> float:
    seen = set(_text(prompt).lower().split())
    words = _text(response).lower().split()
    return sum(w in seen for w in words) / len(words) if words else 0.0


def reward(prompts, responses) -> list[float]:
    """rlhf_dist's reward.function signature: (prompts, responses) -> scores."""
    return [copy_share(p, r) for p, r in zip(prompts, responses)]


def trl_reward(prompts, completions, **kwargs) -> list[float]:
    """TRL's reward_funcs signature."""
    return [copy_share(p, c) for p, c in zip(prompts, completions)]


# --------------------------------------------------------------------------- rollout server

TOKEN_ENV = "RLHF_DIST_BENCH_SERVER_TOKEN"


def start_server(
    model: Path, port: int, threads: int, workdir: Path, dtype: str = "float32",
    batch_window_ms: float = 0.0,
) -> subprocess.Popen:  # fmt: skip
    """`rlhf-dist serve` on `model` at `port`, returned once healthy."""
    from rlhf_dist.generation.server import wait_healthy

    config = workdir / "serve.yaml"
    tree = {"model": {"policy": str(model), "dtype": dtype},
            "serve": {"port": port, "token_env": TOKEN_ENV, "batch_window_ms": batch_window_ms},
            "perf": {"num_threads": threads}}  # fmt: skip
    config.write_text(json.dumps(tree))
    cmd = [sys.executable, "-m", "rlhf_dist", "serve", "--config", str(config)]
    proc = subprocess.Popen(cmd, env=os.environ | {"OMP_NUM_THREADS": str(threads)})
    if wait_healthy(f"http://127.0.0.1:{port}", 300, lambda: proc.poll() is None):
        return proc
    proc.kill()
    raise SystemExit("rlhf-dist serve did not start within 300 s")
