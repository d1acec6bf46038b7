"""SimPO and ORPO: our losses against TRL's CPOTrainer (loss_type="simpo") and ORPOTrainer on
the same pairs (run in the project's .venv; vs_trl_preference.sh runs both sides).

Usage: python launch/bench/vs_trl_preference_ours.py prepare OUT_DIR
       python launch/bench/vs_trl_preference_ours.py compare OUT_DIR

prepare: the demo task and a tiny Llama, SFT for a few steps so that the log-probs are a
trained policy's (a random one's are all about -log V), then OUT_DIR/policy (the model
both sides load), OUT_DIR/pairs.json (token ids of PAIRS held-out preference pairs: the
prompt length and the chosen and rejected sequences; TRL gets these ids, not the text, so
no tokenizer difference can enter), OUT_DIR/settings.json (the loss settings compared)
and OUT_DIR/ours.json with, per setting:
- `step`: the metrics of one `dpo_step` (the trainer's own step: the 16 pairs in 4
  micro-batches of 4, each loss a sum over the global count) and `grads/*.pt` its gradient;
- `eval`: `evaluate_dpo` on the same pairs (the held-out path: every pair in one batch);
- `pairs`: per pair, our mean response log-probs and our per-pair loss term, which the
  TRL side feeds to TRL's loss function (identical inputs: only the formula differs).
compare: reads ours.json and trl.json, prints every figure side by side with the largest
absolute difference, and exits 1 if any exceeds TOLERANCE.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from rlhf_dist.algo.preference import mean_logprobs, orpo_terms, simpo_terms
from rlhf_dist.config import config_from_dict
from rlhf_dist.data.batching import BatchPlan
from rlhf_dist.data.rows import load_rows, preference_pairs
from rlhf_dist.demo import task
from rlhf_dist.distributed import Runtime
from rlhf_dist.models import load_causal_lm
from rlhf_dist.trainers.dpo import dpo_step, evaluate_dpo, pair_sequences
from rlhf_dist.trainers.preference import all_response_logprobs
from rlhf_dist.trainers.sft import train_sft

PAIRS, MICRO = 16, 4
TOLERANCE = 1e-4
DATA = {"max_prompt_length": 16, "max_length": 48}
# What is compared: each is a dpo section of ours and the TRL trainer with the same numbers
# (vs_trl_preference_trl.py maps them: beta, simpo_gamma, label_smoothing; TRL's cpo_alpha 0,
# since SimPO has no NLL term; ORPO's lambda is TRL's beta, its NLL over prompt + response).
SETTINGS = {
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


def prepare(out: Path) -> None:
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
        "data": {**DATA, "train": str(files.sft)}, "sft": sft,
    })  # fmt: skip
    train_sft(cfg, runtime)
    policy = out / "sft" / "final"
    data = config_from_dict({"data": DATA}).data
    pairs = preference_pairs(load_rows(str(files.prefs_eval), "data.eval"), tokenizer, data)[0]
    pairs = pairs[:PAIRS]
    rows = [{"prompt_len": p.prompt_len, "chosen": p.chosen, "rejected": p.rejected} for p in pairs]
    (out / "pairs.json").write_text(json.dumps(rows) + "\n", encoding="utf-8")
    settings = {"policy": str(policy), "pad_id": tokenizer.pad_token_id, "settings": SETTINGS}
    (out / "settings.json").write_text(json.dumps(settings, indent=1) + "\n", encoding="utf-8")
    ours = {name: ours_for(runtime, policy, pairs, tokenizer.pad_token_id, section, out / "grads")
            for name, section in SETTINGS.items()}  # fmt: skip
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


def compare(out: Path) -> int:
    """Print ours next to TRL's; 1 if any difference exceeds TOLERANCE."""
    ours = json.loads((out / "ours.json").read_text(encoding="utf-8"))
    trl = json.loads((out / "trl.json").read_text(encoding="utf-8"))
    worst, lines = 0.0, []
    for name, section in SETTINGS.items():
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=("prepare", "compare"))
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.command == "prepare":
        prepare(args.out)
    else:
        sys.exit(compare(args.out))


if __name__ == "__main__":
    main()
