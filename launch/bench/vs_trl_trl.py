"""TRL 1.10.0's PPOTrainer on the benchmark's shared inputs (run in .venv-trl).

Usage: python launch/bench/vs_trl_trl.py PREPARED_DIR RESULT_JSON [--iterations 6]

PREPARED_DIR is what vs_trl_prepare.py wrote. Writes {"seconds": [per iteration]} to
RESULT_JSON. An iteration is timed from the end of the previous one (or the start of
training) to TRL's `on_step_end` callback, which fires after the rollout, the PPO epochs,
the metrics and the LR-schedule step of each update: everything TRL's loop does per
iteration, as `time/total` is for ours.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
)
from trl.experimental.ppo import PPOConfig, PPOTrainer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trl_timer import IterationTimer  # noqa: E402

# Same numbers as vs_trl_prepare.py (a separate venv cannot import it: no rlhf_dist there).
ROLLOUT_BATCH = 32
RESPONSE_LENGTH = 32
PPO_EPOCHS = 4
MINIBATCHES = 4
TEMPERATURE = 0.7


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prepared", type=Path)
    ap.add_argument("result", type=Path)
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--output-dir", type=Path, default=None)
    # bf16: TRL's own default, mixed precision (fp32 weights, bf16 autocast).
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    args = ap.parse_args()
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


if __name__ == "__main__":
    main()
