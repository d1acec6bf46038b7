"""TRL's side of the TRL side-by-sides (run in TRL's venv; vs_trl.sh runs it).

Usage: python launch/bench/vs_trl_trl.py TASK ARGS...
  ppo PREPARED_DIR RESULT_JSON [--iterations 6] [--precision fp32|bf16]   (TRL 1.10.0, .venv-trl)
  grpo PREPARED_DIR RESULT_JSON --output-dir DIR [--vllm]                 (TRL 1.16.0, .venv-trl-grpo)
  arithmetic PREPARED_DIR RESULT_JSON --output-dir DIR [--seed 0] [--adam-epsilon 1e-8] [--shuffle]
  preference PREPARED_DIR
PREPARED_DIR is what vs_trl_ours.py TASK prepare wrote. Each task imports its own TRL
classes (the two venvs hold different TRL versions); no rlhf_dist here but the arithmetic
task's pure-Python reward, imported from this checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]  # harness; the checkout (rlhf_dist.rewards)

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from harness import trl_reward  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    TrainerCallback,
)


class IterationTimer(TrainerCallback):
    """Wall-clock seconds of each update (= iteration) of a TRL training loop: from the
    start of training or the previous `on_step_end` to the next one."""

    def __init__(self):
        self.seconds: list[float] = []
        self.last = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.last = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self.seconds.append(now - self.last)
        self.last = now


# ==============================================================================================
# ppo
# TRL 1.10.0's PPOTrainer on the benchmark's shared inputs (run in .venv-trl).
#
# Usage: python launch/bench/vs_trl_trl.py ppo PREPARED_DIR RESULT_JSON [--iterations 6]
#
# PREPARED_DIR is what `vs_trl_ours.py ppo prepare` wrote. Writes {"seconds": [per iteration]} to
# RESULT_JSON. An iteration is timed from the end of the previous one (or the start of
# training) to TRL's `on_step_end` callback, which fires after the rollout, the PPO epochs,
# the metrics and the LR-schedule step of each update: everything TRL's loop does per
# iteration, as `time/total` is for ours.


# Same numbers as vs_trl_ours.py's ppo prepare (a separate venv cannot import it: no rlhf_dist there).
ROLLOUT_BATCH = 32


RESPONSE_LENGTH = 32


PPO_EPOCHS = 4


MINIBATCHES = 4


TEMPERATURE = 0.7


def ppo_trl(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(
        description="TRL 1.10.0's PPOTrainer on the benchmark's shared inputs (run in .venv-trl)."
    )
    ap.add_argument("prepared", type=Path)
    ap.add_argument("result", type=Path)
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--output-dir", type=Path, default=None)
    # bf16: TRL's own default, mixed precision (fp32 weights, bf16 autocast).
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    args = ap.parse_args(argv)
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    src = args.prepared
    torch.set_num_threads(os.cpu_count() or 1)  # as ours: all cores for the one process

    tokenizer = AutoTokenizer.from_pretrained(str(src / "policy"))
    # TRL generates from left-padded queries (its collator pads with the tokenizer's side).
    tokenizer.padding_side = "left"
    lines = (src / "prompts.jsonl").read_text(encoding="utf-8").splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines]
    # Token ids exactly as ours encodes prompts: tokenizer(text), no special tokens added.
    dataset = Dataset.from_dict({"input_ids": [tokenizer(p)["input_ids"] for p in prompts]})

    f32 = {"dtype": torch.float32}
    policy = AutoModelForCausalLM.from_pretrained(str(src / "policy"), **f32)
    ref_policy = AutoModelForCausalLM.from_pretrained(str(src / "policy"), **f32)
    # Critic initialised from the reward model, as ours with ppo.critic_init=reward.
    value_model = AutoModelForSequenceClassification.from_pretrained(
        str(src / "reward"), num_labels=1, **f32
    )
    reward_model = AutoModelForSequenceClassification.from_pretrained(
        str(src / "reward"), num_labels=1, **f32
    )

    out = args.output_dir or (args.result.parent / "trl_out")
    config = PPOConfig(
        output_dir=str(out),
        # Batch layout: 32 prompts per update, 4 minibatches of 8, one forward/backward and
        # one optimizer step per minibatch. gradient_accumulation_steps must stay 1: TRL
        # steps its optimizer per micro-batch inside accelerator.accumulate, so a larger
        # value would silently skip optimizer steps.
        per_device_train_batch_size=ROLLOUT_BATCH,
        gradient_accumulation_steps=1,
        num_mini_batches=MINIBATCHES,
        num_ppo_epochs=PPO_EPOCHS,
        local_rollout_forward_batch_size=ROLLOUT_BATCH,
        total_episodes=ROLLOUT_BATCH * args.iterations,
        response_length=RESPONSE_LENGTH,
        stop_token=None,  # no EOS in generation: every response has exactly 32 tokens
        temperature=TEMPERATURE,
        kl_coef=0.05,
        kl_estimator="k1",
        learning_rate=1e-5,
        # TRL's PPOConfig defaults differ from TrainingArguments: bf16=True and
        # gradient_checkpointing=True. Checkpointing off (it recomputes forwards), as ours.
        bf16=args.precision == "bf16",
        fp16=False,
        gradient_checkpointing=False,
        num_sample_generations=0,  # no extra sampling pass over an eval set
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
        use_cpu=not torch.cuda.is_available(),
    )
    timer = IterationTimer()
    trainer = PPOTrainer(
        args=config,
        processing_class=tokenizer,
        model=policy,
        ref_model=ref_policy,
        reward_model=reward_model,
        train_dataset=dataset,
        value_model=value_model,
        eval_dataset=dataset.select(range(ROLLOUT_BATCH)),
        callbacks=[timer],
    )
    trainer.train()
    result = {"seconds": timer.seconds, "precision": args.precision}
    args.result.write_text(json.dumps(result) + "\n", encoding="utf-8")
    print("trl seconds per iteration:", " ".join(f"{s:.3f}" for s in timer.seconds))


# ==============================================================================================
# grpo
# TRL's GRPOTrainer on the GRPO benchmark's shared inputs (run in .venv-trl-grpo).
#
# Usage: python launch/bench/vs_trl_trl.py grpo PREPARED_DIR RESULT_JSON --output-dir DIR [--vllm]
#
# PREPARED_DIR is what `vs_trl_ours.py grpo prepare` wrote; its settings.json gives every number.
# Writes {"seconds": [per iteration]} to RESULT_JSON. An iteration is timed from the end of
# the previous one (or the start of training) to TRL's `on_step_end` callback: generation,
# reward, reference pass, the one optimizer step, metrics and logging, everything TRL's loop
# does per rollout (ours: `time/total`).


def grpo_trl(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(
        description="TRL's GRPOTrainer on the GRPO benchmark's shared inputs (run in .venv-trl-grpo)."
    )
    ap.add_argument("prepared", type=Path)
    ap.add_argument("result", type=Path)
    ap.add_argument("--output-dir", type=Path, required=True)
    # TRL's vLLM colocate mode (one engine in the training process; GPUs only).
    ap.add_argument("--vllm", action="store_true")
    args = ap.parse_args(argv)
    from datasets.table import InMemoryTable
    from trl import GRPOConfig, GRPOTrainer

    s = json.loads((args.prepared / "settings.json").read_text(encoding="utf-8"))
    torch.set_num_threads(s["threads"])
    rows = s["prompts_per_iteration"] * s["samples_per_prompt"]
    lines = (args.prepared / "prompts.jsonl").read_text(encoding="utf-8").splitlines()
    # A fixed fingerprint: datasets otherwise hashes the Arrow table with dill, which on
    # the first GPU loan's image (Python 3.12, pyarrow 24) failed ("Can't pickle
    # MonthDayNano"); the prompts are the same either way.
    table = InMemoryTable.from_pylist([json.loads(line) for line in lines])
    dataset = Dataset(table, fingerprint="vs-trl-grpo-prompts")
    policy = str(args.prepared / "policy")
    config = GRPOConfig(
        # bf16: fp32 weights under bf16 autocast (TRL's mixed precision), as ours does
        # with model.dtype=bfloat16 without DeepSpeed (fp32 masters).
        output_dir=str(args.output_dir), use_cpu=not torch.cuda.is_available(),
        bf16=s.get("dtype") == "bfloat16", seed=0,
        # TRL's configs default to gradient checkpointing (a second forward in the backward);
        # off, as ours runs. The figures in docs/benchmarks.md up to 2026-12-03 had it on.
        gradient_checkpointing=False,
        per_device_train_batch_size=rows, gradient_accumulation_steps=1,
        num_generations=s["samples_per_prompt"], num_iterations=1,
        max_completion_length=s["new_tokens"],
        generation_kwargs={"min_new_tokens": s["new_tokens"]},
        temperature=s["temperature"], top_k=0, top_p=1.0,
        beta=s["kl_coef"], loss_type="dapo", learning_rate=s["lr"],
        lr_scheduler_type="constant", max_steps=s["iterations"], logging_steps=1,
        report_to=[], save_strategy="no", log_completions=False, dataloader_num_workers=0,
        use_vllm=args.vllm, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3,
    )  # fmt: skip
    timer = IterationTimer()
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32),
        reward_funcs=[trl_reward], args=config, train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(policy), callbacks=[timer],
    )  # fmt: skip
    trainer.train()
    args.result.parent.mkdir(parents=True, exist_ok=True)
    args.result.write_text(json.dumps({"seconds": timer.seconds}), encoding="utf-8")
    print("TRL GRPO seconds per iteration:", [round(x, 2) for x in timer.seconds])


# ==============================================================================================
# arithmetic
# TRL's GRPOTrainer on the arithmetic demo's task and settings (run in .venv-trl-grpo).
#
# Usage: python launch/bench/vs_trl_trl.py arithmetic PREPARED_DIR RESULT_JSON --output-dir DIR
#          [--seed 0] [--adam-epsilon 1e-8] [--shuffle]
#
# PREPARED_DIR is what `vs_trl_ours.py arithmetic prepare` wrote. The same SmolLM2 weights, chat
# template, training rows (TRL in file order, ours in its seeded order), reward (rlhf_dist's
# `last_number`, pure Python, imported from this checkout), 8 prompts x 8 samples at
# temperature 1, 24 new tokens, one optimizer step per rollout at lr 2e-5 (constant, AdamW),
# no KL (beta 0), token-mean loss (TRL's "dapo" aggregation), group-std-normalised
# advantages, fp32, 2 threads. Saves the trained policy in DIR/final for the demo's own
# held-out evaluation, and writes {"seconds": [per iteration], "train_seconds"} to RESULT_JSON.
# --adam-epsilon: transformers' 1e-8 by default; 1e-5 is ours (the only setting in which the
# two updates differ on a fixed batch, launch/bench/vs_trl_loss_check.py). --shuffle: TRL
# shuffles the rows by seed (as ours does); without it every seed trains in file order.


def arithmetic_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """TRL's reward_funcs signature over rlhf_dist's `last_number` (message completions)."""
    from rlhf_dist.rewards.tasks import last_number  # pure Python: this checkout, on the path

    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return last_number(prompts, texts, answer)


def arithmetic_trl(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(
        description="TRL's GRPOTrainer on the arithmetic demo's task and settings (run in .venv-trl-grpo)."
    )
    ap.add_argument("prepared", type=Path)
    ap.add_argument("result", type=Path)
    ap.add_argument("--output-dir", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--adam-epsilon", type=float, default=1e-8)
    ap.add_argument("--shuffle", action="store_true")
    args = ap.parse_args(argv)
    from trl import GRPOConfig, GRPOTrainer

    s = json.loads((args.prepared / "settings.json").read_text(encoding="utf-8"))
    torch.set_num_threads(s["threads"])
    rows = s["prompts_per_iteration"] * s["samples_per_prompt"]
    lines = (args.prepared / "train.jsonl").read_text(encoding="utf-8").splitlines()
    dataset = Dataset.from_list([json.loads(line) for line in lines])
    config = GRPOConfig(
        output_dir=str(args.output_dir), use_cpu=not torch.cuda.is_available(), seed=args.seed,
        # fp32 and no activation checkpointing, as ours runs. TRL's defaults are bf16 autocast
        # (on a CPU without AVX-512 BF16 or AMX a reference GEMM: 882 s a step on a 2-core AMD
        # EPYC, against 88 s in fp32) and gradient checkpointing.
        bf16=False, gradient_checkpointing=False,
        per_device_train_batch_size=rows, gradient_accumulation_steps=1,
        num_generations=s["samples_per_prompt"], num_iterations=1,
        max_completion_length=s["new_tokens"], temperature=s["temperature"], top_k=0, top_p=1.0,
        beta=s["kl_coef"], loss_type="dapo", scale_rewards="group", learning_rate=s["lr"],
        lr_scheduler_type="constant", warmup_steps=0, max_steps=s["iterations"],
        adam_epsilon=args.adam_epsilon, shuffle_dataset=args.shuffle, logging_steps=1, report_to=[], save_strategy="no",
        log_completions=False, dataloader_num_workers=0, use_vllm=False,
    )  # fmt: skip
    timer = IterationTimer()
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(s["policy"], dtype=torch.float32),
        reward_funcs=[arithmetic_reward], args=config, train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(s["policy"]), callbacks=[timer],
    )  # fmt: skip
    start = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - start
    trainer.save_model(str(args.output_dir / "final"))
    args.result.parent.mkdir(parents=True, exist_ok=True)
    result = {"seconds": timer.seconds, "train_seconds": train_seconds}
    args.result.write_text(json.dumps(result), encoding="utf-8")
    print(f"TRL GRPO: {len(timer.seconds)} iterations in {train_seconds:.0f} s")


# ==============================================================================================
# preference
# TRL's SimPO (CPOTrainer, loss_type="simpo") and ORPOTrainer on the preference benchmark's
# pairs (run in .venv-trl-grpo, TRL 1.16.0; `vs_trl.sh preference` runs both sides).
#
# Usage: python launch/bench/vs_trl_trl.py preference PREPARED_DIR
#
# PREPARED_DIR is what `vs_trl_ours.py preference prepare` wrote. For each setting of its
# settings.json this builds TRL's trainer on the same policy and hands it the same token ids
# as one collated batch (TRL's own layout: chosen_/rejected_ input_ids, attention_mask, and
# labels with -100 on the prompt and the padding), then records
# - `metrics`: TRL's loss and logged metrics of `get_batch_loss_metrics` (its training
#   loss: one forward of chosen and rejected concatenated), and grads/trl_*.pt the gradient
#   of that loss;
# - `chosen_mean` / `rejected_mean`: the per-pair mean log-probs of TRL's forward;
# - `pair_loss`: TRL's per-pair loss function (`cpo_loss` / `odds_ratio_loss`) applied to OUR
#   per-pair mean log-probs, in our sign (ORPO's term is -losses: TRL returns beta x log
#   sigmoid and subtracts it).
# Writes PREPARED_DIR/trl.json.


def collated(pairs: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """The batch TRL's DPODataCollatorWithPadding makes of tokenised rows, right-padded."""
    batch = {}
    for side in ("chosen", "rejected"):
        width = max(len(p[side]) for p in pairs)
        ids = torch.full((len(pairs), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(pairs), width), dtype=torch.long)
        labels = torch.full((len(pairs), width), -100, dtype=torch.long)
        for i, p in enumerate(pairs):
            seq, n = torch.tensor(p[side]), len(p[side])
            ids[i, :n], mask[i, :n] = seq, 1
            labels[i, p["prompt_len"] : n] = seq[p["prompt_len"] :]
        batch |= {
            f"{side}_input_ids": ids,
            f"{side}_attention_mask": mask,
            f"{side}_labels": labels,
        }
    return batch


def trainer_for(section: dict, policy: str, tokenizer, out: str):
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    """TRL's trainer with the setting's numbers; the dataset it requires is never read."""
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    rows = Dataset.from_dict({"prompt": ["good"], "chosen": [" great"], "rejected": [" bad"]})
    common = {"output_dir": out, "use_cpu": True, "report_to": [], "max_length": 64,
              "beta": section["beta"], "per_device_train_batch_size": 1}  # fmt: skip
    if section["loss_type"] == "simpo":
        args = CPOConfig(
            **common, loss_type="simpo", cpo_alpha=0.0, simpo_gamma=section["simpo_gamma"],
            label_smoothing=section.get("label_smoothing", 0.0),
        )  # fmt: skip
        return CPOTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer)
    args = ORPOConfig(**common)
    return ORPOTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer)


def trl_for(name: str, section: dict, s: dict, pairs: list[dict], ours: dict, out: Path) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(s["policy"])
    with tempfile.TemporaryDirectory() as tmp:
        trainer = trainer_for(section, s["policy"], tokenizer, tmp)
    model, batch = trainer.model, collated(pairs, s["pad_id"])
    model.zero_grad()
    loss, metrics = trainer.get_batch_loss_metrics(model, batch)
    loss.backward()
    torch.save({n: p.grad for n, p in model.named_parameters()}, out / "grads" / f"trl_{name}.pt")
    with torch.no_grad():
        chosen, rejected = trainer.concatenated_forward(model, batch)[:2]
        ours_chosen = torch.tensor(ours["pairs"]["chosen_mean"])
        ours_rejected = torch.tensor(ours["pairs"]["rejected_mean"])
        if section["loss_type"] == "simpo":
            pair_loss = trainer.cpo_loss(ours_chosen, ours_rejected)[0]
        else:
            pair_loss = -trainer.odds_ratio_loss(ours_chosen, ours_rejected)[0]
    return {
        "metrics": {"loss": float(loss)} | {k: float(v) for k, v in metrics.items()},
        "chosen_mean": chosen.tolist(),
        "rejected_mean": rejected.tolist(),
        "pair_loss": pair_loss.tolist(),
    }


def preference_trl(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(
        description="TRL's SimPO (CPOTrainer, loss_type=\"simpo\") and ORPOTrainer on the preference benchmark's"
    )
    ap.add_argument("prepared", type=Path)
    out = ap.parse_args(argv).prepared
    torch.set_num_threads(1)
    s = json.loads((out / "settings.json").read_text(encoding="utf-8"))
    pairs = json.loads((out / "pairs.json").read_text(encoding="utf-8"))
    ours = json.loads((out / "ours.json").read_text(encoding="utf-8"))
    result = {
        name: trl_for(section_name(section), section, s, pairs, ours[name], out)
        for name, section in s["settings"].items()
    }
    (out / "trl.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


def section_name(section: dict) -> str:
    """The gradient file's name, as vs_trl_ours.py preference writes it."""
    return "_".join(f"{k}-{v}" for k, v in sorted(section.items()))


TASKS = {
    "ppo": ppo_trl,
    "grpo": grpo_trl,
    "arithmetic": arithmetic_trl,
    "preference": preference_trl,
}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in TASKS:
        raise SystemExit(f"usage: vs_trl_trl.py TASK ARGS... (TASK: {', '.join(TASKS)})")
    sys.argv[0] = " ".join(sys.argv[:2])  # each step's --help names it
    TASKS[sys.argv[1]](sys.argv[2:])


if __name__ == "__main__":
    main()
