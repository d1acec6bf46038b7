"""Packed, padding-free sequences on a real model (issue #23): one log-prob forward and
one forward + backward of `engine.forward.token_logprobs` over a rollout-shaped batch (left-padded
prompts, right-padded responses of ragged lengths), padded vs `perf.packed_sequences`,
per attention implementation.

    python launch/bench/packing_real.py [--model DIR] [--rows 8] [--max-len 256]
        [--reps 3] [--attn sdpa,eager]

--model defaults to SmolLM2-135M-Instruct as shipped (rlhf_dist.demo.smollm2.build, cached).
Prints, per setting, the token slots the backbone computed, the median seconds (wall, and
CPU seconds of this process, which other processes' load disturbs less) of the no-grad
forward (rollout scoring) and of the forward + backward (an update's micro-batch),
and the largest log-prob difference to the padded forward. Run with PYTHONPATH set to the
tree to measure; times on a shared CPU are noisy (alternate settings, take medians).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def rollout_batch(rows: int, max_len: int, vocab: int, seed: int = 0):
    """(ids, attention_mask, response_mask): prompts of 8..max_len/4 tokens left-padded to
    max_len/4, responses of 8..3*max_len/4 tokens right-padded."""
    g = torch.Generator().manual_seed(seed)
    P, T = max_len // 4, max_len - max_len // 4
    prompt = torch.randint(8, P + 1, (rows,), generator=g)
    response = torch.randint(8, T + 1, (rows,), generator=g)
    ids = torch.randint(0, vocab, (rows, P + T), generator=g)
    prompt_mask = torch.arange(P) >= P - prompt[:, None]
    response_mask = torch.arange(T) < response[:, None]
    return ids, torch.cat([prompt_mask, response_mask], 1).long(), response_mask


def bench(lm, batch, reps: int) -> dict:
    """Per setting (False: padded, True: packed): token slots of the backbone's forward,
    median seconds of the no-grad forward and of forward + backward, settings alternated
    in every round; and the largest log-prob difference between the two."""
    from rlhf_dist.engine import forward, packing

    ids, attention, mask = batch
    slots, original = [], packing.backbone_inputs

    def counting(*args):
        inputs = original(*args)
        slots.append(inputs["input_ids"].numel())
        return inputs

    def step():
        lp, _ = forward.token_logprobs(lm, ids, attention, mask)
        lp.sum().backward()

    keys = ("forward_s", "fwd_bwd_s", "forward_cpu", "fwd_bwd_cpu")
    out = {packed: {k: [] for k in keys} for packed in (False, True)}
    packing.backbone_inputs = counting
    try:
        for _ in range(reps):
            for packed in (False, True):
                lm.packed_sequences = packed
                with torch.no_grad():
                    start, cpu_start = time.perf_counter(), time.process_time()
                    out[packed]["lp"], _ = forward.token_logprobs(lm, ids, attention, mask)
                    middle, cpu_middle = time.perf_counter(), time.process_time()
                step()
                r = out[packed]
                r["forward_s"].append(middle - start)
                r["fwd_bwd_s"].append(time.perf_counter() - middle)
                r["forward_cpu"].append(cpu_middle - cpu_start)
                r["fwd_bwd_cpu"].append(time.process_time() - cpu_middle)
                r["slots"] = slots[-2]
    finally:
        packing.backbone_inputs = original
    for r in out.values():
        r.update({k: statistics.median(r[k]) for k in keys})
    diff = (out[True]["lp"] - out[False]["lp"]).abs().max().item()
    return {"real": int(attention.sum()), "diff": diff, **out}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--attn", default="sdpa,eager")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from rlhf_dist.models import disable_dropout, quiet_transformers

    quiet_transformers()
    torch.manual_seed(0)
    if not args.model:
        from rlhf_dist.demo import smollm2

        args.model = str(smollm2.build("shipped"))
    print(f"model {args.model}, {args.rows} rows x {args.max_len}, torch threads "
          f"{torch.get_num_threads()}")  # fmt: skip
    header = f"{'attn':<6} {'packed':<6} {'slots':>6} {'real':>6} {'fwd s':>7} {'fwd+bwd s':>9}"
    print(f"{header} {'fwd cpu-s':>9} {'fwd+bwd cpu-s':>13}")
    for attn in args.attn.split(","):
        lm = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation=attn)
        lm = disable_dropout(lm).train()
        batch = rollout_batch(args.rows, args.max_len, lm.config.vocab_size)
        result = bench(lm, batch, args.reps)
        for packed in (False, True):
            r = result[packed]
            print(
                f"{attn:<6} {str(packed):<6} {r['slots']:>6} {result['real']:>6} "
                f"{r['forward_s']:>7.3f} {r['fwd_bwd_s']:>9.3f} {r['forward_cpu']:>9.3f} "
                f"{r['fwd_bwd_cpu']:>13.3f}"
            )
        print(f"{attn}: largest |packed - padded| log-prob difference {result['diff']:.2e}")


if __name__ == "__main__":
    main()
