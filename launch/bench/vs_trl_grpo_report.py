"""Summarise the GRPO rounds against TRL's GRPOTrainer and compute the FLOP floor (run in .venv).

Usage: python launch/bench/vs_trl_grpo_report.py PREPARED_DIR RESULTS_DIR [--warmup 1]

RESULTS_DIR holds round<k>/ours/metrics.jsonl (`time/total` per iteration) and
round<k>/trl.json from vs_trl_grpo.sh. The first `--warmup` iterations of every run are
dropped (allocator growth, lazy initialisation), the rest pooled over rounds.

The FLOP floor is the time one iteration would take doing only its necessary matrix
products at the rate this machine reaches on them, measured in the same run: generation
(every prompt and response token through the actor once, a KV cache), the reference pass,
and the update (forward + backward = 3 forwards). The old log-probs need no pass of their
own with one optimizer step per rollout (both trainers skip it). Two rates are reported:
one matmul of the update's shape for everything (the strict floor), and the decode steps
at the shape they really have, (rows, hidden) x (hidden, intermediate).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_trl_report import (  # noqa: E402
    forward_flops,
    matmul_rate,
    median_spread,
    model_shapes,
    read_rounds,
)

NOTES = """\
Fairness notes (same weights, tokenizer, chat template, prompts, reward, threads, fp32):
- Both sample exactly new_tokens per response (EOS suppressed until then: ours
  generation.min_new_tokens, TRL generation_kwargs min_new_tokens), temperature 1, no
  top-k/top-p, so both do the same work per row; responses differ (different RNG streams).
- One optimizer step per rollout of 16 rows, one micro-batch (TRL per_device_train_batch_size
  16, no accumulation); k3 KL in the loss at beta 0.04 against a frozen fp32 reference;
  token-mean loss (TRL loss_type="dapo"); group-std-normalised advantages; clip 0.2; grad
  clipping at norm 1 on both (TRL's default max_grad_norm=1.0); constant LR 1e-5.
- Host memory: ours keeps freed memory for reuse (perf.retain_host_memory, on by default;
  OURS_ARGS=perf.retain_host_memory=false for glibc's defaults); TRL runs with glibc's
  defaults, as its users run it, unless TRL_RETAIN=1 (the same through MALLOC_* variables).
- Timing: ours is `time/total` (rollout + update inside the loop); TRL's is wall clock
  between `on_step_end` callbacks, which includes its logging (logging_steps=1)."""


def prompt_tokens(prepared: Path) -> float:
    """Mean prompt length in tokens after the model's chat template (generation prompt on)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(prepared / "policy"))
    lines = (prepared / "prompts.jsonl").read_text(encoding="utf-8").splitlines()
    texts = [
        tok.apply_chat_template(json.loads(x)["prompt"], add_generation_prompt=True, tokenize=False)
        for x in lines
    ]
    return statistics.mean(len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts)


def flop_floor(prepared: Path) -> dict:
    s = json.loads((prepared / "settings.json").read_text(encoding="utf-8"))
    rows, T = s["prompts_per_iteration"] * s["samples_per_prompt"], s["new_tokens"]
    P = prompt_tokens(prepared)
    L = P + T
    actor = model_shapes(prepared / "policy")
    prefill = rows * forward_flops(actor, P, 1)
    decode = rows * forward_flops(actor, L, T) - prefill  # one token per row per step
    reference = rows * forward_flops(actor, L, T)
    update = 3 * rows * forward_flops(actor, L, T)
    import torch

    torch.set_num_threads(s["threads"])
    d, f = actor["hidden"], actor["intermediate"]
    big = matmul_rate(int(round(rows * L)), d, f)  # the update's and scoring's MLP shape
    small = matmul_rate(rows, d, f)  # one decode step's MLP shape
    total = prefill + decode + reference + update
    # The work left when each distinct prompt runs once (ours' perf.shared_prompt_forward):
    # the projections of the prompt tokens of n - 1 of every n rows are not needed in the
    # prefill, the reference pass and the update's forward + backward (5 forwards' worth);
    # the attention over the prompt is still counted for every row.
    repeated = rows - s["prompts_per_iteration"]
    shared = total - 5 * repeated * 2 * actor["body"] * P
    return {
        "rows": rows, "new_tokens": T, "prompt_tokens_mean": P, "size": s["size"],
        "params_matmul": actor["body"] + actor["lm_head"],
        "flops_generate": prefill + decode, "flops_reference": reference,
        "flops_update": update, "flops_total": total,
        "rate_update_shape": big, "rate_decode_shape": small,
        "floor_s": total / big,
        "floor_s_decode_at_its_shape": (prefill + reference + update) / big + decode / small,
        "flops_total_shared_prompts": shared, "floor_s_shared_prompts": shared / big,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prepared", type=Path)
    ap.add_argument("results", type=Path)
    ap.add_argument("--warmup", type=int, default=1)
    args = ap.parse_args()
    ours, trl, phases = read_rounds(args.results, args.warmup, set())
    all_ours, all_trl = [x for r in ours for x in r], [x for r in trl for x in r]
    fl = flop_floor(args.prepared)
    out = {"ours": ours, "trl": trl, "floor": fl}
    print(f"== GRPO, rlhf_dist vs TRL GRPOTrainer: s/iteration ({fl['size']}, warm-up dropped)")
    print(
        f"   {fl['rows']} rows x {fl['new_tokens']} new tokens, prompt {fl['prompt_tokens_mean']:.1f}"
    )
    if all_ours:
        print(f"   ours  {median_spread(all_ours)}")
        for k, v in phases.items():
            if v:
                print(f"         {k:14s} median {statistics.median(v):.3f} s")
    if all_trl:
        print(f"   TRL   {median_spread(all_trl)}")
    if all_ours and all_trl:
        out["ratio"] = statistics.median(all_ours) / statistics.median(all_trl)
        per_round = [statistics.median(o) / statistics.median(t) for o, t in zip(ours, trl)]
        out["ratio_per_round"] = per_round
        rounds = ", ".join(f"{r:.2f}" for r in per_round)
        print(f"   ratio ours/TRL {out['ratio']:.2f} (per round {rounds}; < 1: ours faster)")
    print(f"== FLOP floor ({fl['params_matmul'] / 1e6:.1f}M matmul params)")
    print(
        f"   FLOPs: generate {fl['flops_generate']:.3g}, reference {fl['flops_reference']:.3g}, "
        f"update {fl['flops_update']:.3g}, total {fl['flops_total']:.3g}"
    )
    print(
        f"   fp32 matmul rate: {fl['rate_update_shape'] / 1e9:.1f} GFLOP/s at the update's "
        f"shape, {fl['rate_decode_shape'] / 1e9:.1f} at a decode step's"
    )
    print(
        f"   floor {fl['floor_s']:.2f} s (one rate); {fl['floor_s_decode_at_its_shape']:.2f} s "
        "(decode at its own shape)"
    )
    print(
        f"   floor {fl['floor_s_shared_prompts']:.2f} s with each distinct prompt run once "
        f"({fl['flops_total_shared_prompts']:.3g} FLOPs; ours does this, TRL does not)"
    )
    if all_ours:
        m = statistics.median(all_ours)
        out["ours_over_floor_shared_prompts"] = m / fl["floor_s_shared_prompts"]
        print(f"   ours/floor with shared prompts {m / fl['floor_s_shared_prompts']:.2f}x")
    for name, xs in (("ours", all_ours), ("TRL", all_trl)):
        if xs:
            m = statistics.median(xs)
            out[f"{name}_over_floor"] = m / fl["floor_s"]
            out[f"{name}_over_floor_decode_shape"] = m / fl["floor_s_decode_at_its_shape"]
            print(
                f"   {name}/floor {m / fl['floor_s']:.2f}x (one rate), "
                f"{m / fl['floor_s_decode_at_its_shape']:.2f}x (decode at its shape)"
            )
    print(NOTES)
    (args.results / "summary.json").write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
