"""Summarise the rlhf_dist-vs-TRL rounds and compute the FLOP floor (run in .venv).

Usage: python launch/bench/vs_trl_report.py PREPARED_DIR RESULTS_DIR [--warmup 1]

RESULTS_DIR holds round<k>/ours/metrics.jsonl (`time/total` per iteration) and
round<k>/trl.json ({"seconds": [...]}) from vs_trl.sh. The first `--warmup` iterations of
every run are dropped (allocator growth, lazy initialisation), the rest pooled over rounds.

The FLOP floor is the time one iteration would take if it did only its necessary matrix
products at the rate this machine reaches on matmuls of the model's own shapes: it says
how far either loop is from the hardware, which a ratio of two loops cannot.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

# Mirrors vs_trl_prepare.py.
ROLLOUT_BATCH = 32
RESPONSE_LENGTH = 32
PPO_EPOCHS = 4


FAIRNESS_NOTES = """\
Fairness notes (what differs between the two loops; same weights, prompts, threads):
- Precision: fp32 runs are fp32 on both sides. In bf16 runs ours keeps bf16 weights
  (model.dtype=bfloat16: without DeepSpeed, no fp32 master copy) and TRL its default
  mixed precision (fp32 weights, bf16 autocast): each side's fastest bf16 setting.
- Timing: ours is `time/total` from metrics.jsonl (rollout + update, measured inside the
  loop; metrics writing and alerts after it are excluded); TRL's is wall clock between
  consecutive `on_step_end` callbacks, so it also includes its metrics gathering, logging,
  LR-schedule step and the gc.collect() it runs every iteration.
- Old log-probs: TRL keeps the sampling logits of generate() (output_scores=True, a
  (32, 32, vocab) tensor) and takes log-probs from them; ours recomputes them with one
  extra actor forward over prompt+response, fused with the critic's value forward.
- Forward passes: TRL calls every model with output_hidden_states=True and computes
  logits at every position; ours asks the actor for logits of the response positions only
  (logits_to_keep) and reads hidden states of the critic/reward backbone directly.
- Generation: TRL uses transformers' generate() and removes EOS from the generation
  config (stop_token=None); ours runs its own KV-cache decode loop and keeps EOS but
  suppresses it until 32 tokens (min_new_tokens=32). Both sample exactly 32 tokens with
  temperature 0.7, top_k 0, top_p 1.
- Update: both do 4 epochs x 4 minibatches of 8 with one forward/backward and one Adam
  step per minibatch (16 steps). Ours clips the actor's and critic's gradients to norm 1
  (two norm computations per step) and checks the loss and gradients for non-finite
  values before stepping; TRL's loop never clips (it calls optimizer.step() directly).
  TRL also computes the full-vocabulary entropy of every minibatch for its statistics.
- Losses: ours divides token sums by the minibatch's token count and whitens advantages
  with statistics over all ranks; TRL uses masked means per micro-batch and whitens
  locally. With one process and equal-length responses both come to the same arithmetic.
- Schedules and defaults that do not change the amount of work: TRL's LR decays linearly,
  ours is constant; Adam eps 1e-8 (TRL) vs 1e-5 (ours).
- Padding: both left-pad prompts to the longest prompt of the batch; the floor counts
  real tokens only."""


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


def matmul_rate(m: int, k: int, n: int, seconds: float = 1.0, dtype=torch.float32) -> float:
    """Measured FLOP/s of (m, k) @ (k, n) on this machine: the fastest of repeated runs,
    since a floor wants the best rate the machine reaches, not one disturbed by others."""
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
    """Matmul parameter counts of a saved Llama: body (per token), lm_head, layers, hidden."""
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
    }


def forward_flops(s: dict, length: float, head_tokens: float) -> float:
    """FLOPs of one causal forward over `length` tokens with the LM head on `head_tokens`.

    2 FLOPs per weight per token for the projections, plus attention scores and the
    weighted sum: 2 * 2 * d per (query, key) pair, length^2 / 2 pairs under the causal mask.
    """
    attention = 4 * s["hidden"] * s["layers"] * length * length / 2
    return 2 * s["body"] * length + 2 * s["lm_head"] * head_tokens + attention


def flop_floor(prepared: Path) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(prepared / "policy"))
    lines = (prepared / "prompts.jsonl").read_text(encoding="utf-8").splitlines()
    prompt_lens = [len(tok(json.loads(line)["prompt"])["input_ids"]) for line in lines]
    P, T, B = statistics.mean(prompt_lens), RESPONSE_LENGTH, ROLLOUT_BATCH
    L = P + T
    actor = model_shapes(prepared / "policy")
    critic = dict(model_shapes(prepared / "reward"), lm_head=actor["hidden"])  # 1-output head
    # Generation with a KV cache: every prompt and response token goes through the actor
    # once (prefill + one step per new token); logits are needed for the T sampled tokens.
    gen = B * forward_flops(actor, L, T)
    # Scoring: actor (old log-probs), reference, critic (values), reward model, one forward
    # each over the full sequences; log-probs need logits at the T response positions.
    score = B * (2 * forward_flops(actor, L, T) + 2 * forward_flops(critic, L, L))
    # Update: per epoch a forward + backward (= 3 forwards) of actor and critic per sequence.
    update = PPO_EPOCHS * B * 3 * (forward_flops(actor, L, T) + forward_flops(critic, L, L))
    # The rate at the shapes these models run: (tokens of a minibatch, hidden) x (hidden,
    # intermediate), the MLP's up projection; a large square matmul for the machine's peak.
    tokens = int(round(8 * L))
    dtype = precision_of(prepared)
    rate = matmul_rate(tokens, actor["hidden"], actor["intermediate"], dtype=dtype)
    peak = matmul_rate(2048, 2048, 2048, dtype=dtype)
    total = gen + score + update
    return {
        "prompt_tokens_mean": P,
        "params_actor_matmul": actor["body"] + actor["lm_head"],
        "params_critic_matmul": critic["body"] + critic["lm_head"],
        "flops_generate": gen,
        "flops_score": score,
        "flops_update": update,
        "flops_total": total,
        "matmul_shape": (tokens, actor["hidden"], actor["intermediate"]),
        "matmul_rate": rate,
        "matmul_peak_2048": peak,
        "floor_s": total / rate,
        "floor_s_at_peak": total / peak,
        "dtype": str(dtype).removeprefix("torch."),
    }


def trl_precision_of(results: Path) -> str:
    """What the TRL runs used (vs_trl_trl.py --precision)."""
    runs = sorted(results.glob("round*/trl.json"))  # every round runs the same settings
    if not runs:
        return "-"
    bf16 = json.loads(runs[0].read_text(encoding="utf-8")).get("precision") == "bf16"
    return "fp32 weights + bf16 autocast" if bf16 else "fp32"


def precision_of(prepared: Path) -> torch.dtype:
    """The trained dtype of the prepared run (ours.yaml is JSON)."""
    cfg = json.loads((prepared / "ours.yaml").read_text(encoding="utf-8"))
    return getattr(torch, cfg["model"]["dtype"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prepared", type=Path)
    ap.add_argument("results", type=Path)
    ap.add_argument("--warmup", type=int, default=1)
    # A round disturbed by something else on the machine can be left out: --skip 1,3.
    ap.add_argument("--skip", default="", help="comma-separated round numbers to leave out")
    args = ap.parse_args()
    ours, trl, phases = read_rounds(args.results, args.warmup, set(args.skip.split(",")) - {""})
    all_ours = [s for r in ours for s in r]
    all_trl = [s for r in trl for s in r]
    floor = flop_floor(args.prepared)
    out = {"ours": ours, "trl": trl, "floor": floor}

    print(f"== rlhf_dist vs TRL 1.10.0: seconds per PPO iteration (warm-up {args.warmup} dropped)")
    print(
        f"   batch {ROLLOUT_BATCH}, response {RESPONSE_LENGTH} tokens, {PPO_EPOCHS} epochs x 4 mb"
    )
    trl_precision = trl_precision_of(args.results)
    print(f"   precision: ours {floor['dtype']} weights; TRL {trl_precision}")
    if all_ours:
        print(f"   ours  {median_spread(all_ours)}")
        for k, v in phases.items():
            print(f"         {k:14s} median {statistics.median(v):.3f} s")
    if all_trl:
        print(f"   TRL   {median_spread(all_trl)}")
    if all_ours and all_trl:
        ratio = statistics.median(all_ours) / statistics.median(all_trl)
        per_round = [
            statistics.median(o) / statistics.median(t) for o, t in zip(ours, trl, strict=False)
        ]
        out["ratio"] = ratio
        out["ratio_per_round"] = per_round
        rounds = ", ".join(f"{r:.2f}" for r in per_round)
        print(f"   ratio ours/TRL {ratio:.2f} (per round: {rounds}; < 1 means ours is faster)")
        # The fastest iterations are the least disturbed by other load on a shared machine.
        print(f"   ratio of the fastest iterations {min(all_ours) / min(all_trl):.2f}")
    m, k, n = floor["matmul_shape"]
    print(f"== FLOP floor (counted FLOPs / measured {floor['dtype']} matmul rate)")
    print(
        f"   actor {floor['params_actor_matmul'] / 1e6:.3f}M matmul params, critic/RM "
        f"{floor['params_critic_matmul'] / 1e6:.3f}M, mean prompt {floor['prompt_tokens_mean']:.1f}"
        " tokens"
    )
    print(
        f"   FLOPs per iteration: generate {floor['flops_generate']:.3g}, score "
        f"{floor['flops_score']:.3g}, update {floor['flops_update']:.3g}, total "
        f"{floor['flops_total']:.3g}"
    )
    print(
        f"   matmul ({m}x{k})@({k}x{n}): {floor['matmul_rate'] / 1e9:.1f} GFLOP/s; "
        f"2048^3: {floor['matmul_peak_2048'] / 1e9:.1f} GFLOP/s"
    )
    print(
        f"   floor {floor['floor_s'] * 1e3:.2f} ms at the model-shape rate "
        f"({floor['floor_s_at_peak'] * 1e3:.2f} ms at the 2048^3 rate)"
    )
    if all_ours:
        x = statistics.median(all_ours) / floor["floor_s"]
        out["ours_over_floor"] = x
        print(f"   ours/floor {x:.0f}x")
    if all_trl:
        x = statistics.median(all_trl) / floor["floor_s"]
        out["trl_over_floor"] = x
        print(f"   TRL/floor  {x:.0f}x")
    print(FAIRNESS_NOTES)
    (args.results / "summary.json").write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
