"""`rlhf-dist demo`: generate the offline task, then SFT -> RM -> PPO (or another algorithm,
--algorithm) -> eval on tiny models.

Every stage is an ordinary run of the public trainers with an ordinary config (written to
DIR/<stage>/config.yaml), so the demo exercises exactly the code users run.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlhf_dist.config import Config, apply_override, config_from_dict, validate
from rlhf_dist.demo import task
from rlhf_dist.errors import ConfigError
from rlhf_dist.names import (
    DEMO_ALGORITHMS,
    DEMO_ITERATIVE,
    DEMO_OBJECTIVES,
    DEMO_OFFLINE,
    DEMO_RL_ALGORITHMS,
)

if TYPE_CHECKING:  # torch loads when a stage runs (rlhf-dist --help stays instant)
    from rlhf_dist.distributed import Runtime

GOLD = "rlhf_dist.demo.task:gold_reward_eval"

# The algorithms' names live in rlhf_dist/names.py (the CLI's choices, torch-free): the
# on-policy ones the demo runs with `rlhf-dist ppo` and a reward model (PPO, the
# critic-free estimators, each its own ppo.estimator, then the objectives below on GRPO's
# estimator), the offline ones (`rlhf-dist dpo` / `kto`) and iterative RLHF.
RL_ALGORITHMS, OFFLINE, ITERATIVE = DEMO_RL_ALGORITHMS, DEMO_OFFLINE, DEMO_ITERATIVE
ALGORITHMS = DEMO_ALGORITHMS
# GSPO, CISPO and DAPO: the ppo keys each preset sets over GRPO's (docs/agents.md,
# "Objectives"; README, "Algorithms on the demo", has the measured figures).
OBJECTIVE_PRESETS = {
    # sequence ratio, per-sequence token means as in GSPO's paper; a narrower clip, as the
    # length-normalised ratio moves less than a token's
    "gspo": {
        "ratio_level": "sequence",
        "loss_aggregation": "seq_mean_token_mean",
        "clip_eps": 0.1,
    },
    # MiniMax-M1: an upper bound on the stop-gradient IS weight only
    "cispo": {"policy_loss": "cispo", "clip_eps_low": 1.0, "clip_eps_high": 0.28},
    # DAPO: clip-higher, token-mean, dynamic sampling, soft overlong penalty
    "dapo": {
        "clip_eps": 0.2,
        "clip_eps_high": 0.28,
        "loss_aggregation": "token_mean",
        "dynamic_sampling": True,
        "overlong": "soft",
        "overlong_buffer": 8,
    },
}
assert tuple(OBJECTIVE_PRESETS) == DEMO_OBJECTIVES  # one list of the presets' names
# Online DPO labelled by the reward model (docs/online_dpo.md, "On the demo"): 32 prompts x
# 4 samples (32 pairs, the best against the worst), beta (kl_coef) 0.1 as TRL's default,
# ONE optimizer step per iteration on all pairs (TRL's one step per generation batch) at
# lr 3e-4: DPO has no clip to bound a step, so PPO's several epochs and minibatches per
# iteration move the policy far from the reference (the figures: docs/online_dpo.md).
ONLINE_DPO = {
    "estimator": "online_dpo",
    "rollout_batch_size": 32,
    "kl_coef": 0.1,
    "ppo_epochs": 1,
    "minibatch_size": 0,
    "optim": {"lr": 3e-4},
}


def demo_model(**paths: str) -> dict:
    """A demo stage's `model` section: its paths, and the precision the demo's figures were
    measured with, whatever the package defaults (fp32, no gradient checkpointing: tiny
    models, where neither pays)."""
    return {**paths, "dtype": "float32", "gradient_checkpointing": False}


def rl_section(algorithm: str, scale: float) -> dict:
    """The `ppo` section of the demo's RL stage. Every algorithm but online DPO sees 64
    sequences per iteration: PPO 64 prompts once, the group estimators 16 prompts x 4
    samples; online DPO 32 prompts x 4 (ONLINE_DPO)."""
    common = {
        "iterations": max(2, int(60 * scale)),
        "rollout_micro_batch_size": 64,
        "ppo_epochs": 4,
        "minibatch_size": 16,
        "micro_batch_size": 16,
        "optim": {"lr": 3e-4},
        "kl_coef": 0.05,
    }
    if algorithm == "ppo":
        return {**common, "rollout_batch_size": 64, "critic_optim": {"lr": 3e-4}}
    groups = {"rollout_batch_size": 16, "samples_per_prompt": 4}
    if algorithm == "online_dpo":  # best of 4 against worst of 4: 16 pairs per iteration
        return {**common, **groups, **ONLINE_DPO}
    if algorithm in OBJECTIVE_PRESETS:
        return {**common, "estimator": "grpo", **groups, **OBJECTIVE_PRESETS[algorithm]}
    return {**common, "estimator": algorithm, **groups}


def step_loop_stage(stage: str, run: dict, model: dict, data: dict, epochs: int, lr: float) -> dict:
    """The tree of a demo stage on the SFT/RM step loop: 32 rows per step, one micro-batch,
    a cosine schedule after 10 warmup steps."""
    optim = {"lr": lr, "schedule": "cosine", "warmup_steps": 10}
    section = {"epochs": epochs, "batch_size": 32, "micro_batch_size": 32, "optim": optim}
    return {"run": run, "model": demo_model(**model), "data": data, stage: section}


def stage_configs(
    root: Path, files: task.TaskFiles, models: dict, seed: int, quick: bool, algorithm: str = "ppo"
) -> dict:
    """The config tree of every stage. Numbers tuned for a 2-core CPU (see README)."""

    # RL logs every 2nd iteration (smooth report curves, a readable console), SFT/RM every 10th.
    def run(name: str) -> dict:
        return {
            "output_dir": str(root / name),
            "seed": seed,
            "log_every": 2 if name == algorithm else 10,
        }

    data = {"max_prompt_length": 16, "max_length": 48}
    gen = {"max_new_tokens": 24, "temperature": 0.7}
    sft_policy, rm_path = str(root / "sft" / "final"), str(root / "rm" / "final")
    scale = 0.1 if quick else 1.0
    prefs = {"train": str(files.prefs_train), "eval": str(files.prefs_eval)}
    return {
        "sft": step_loop_stage(
            "sft",
            run("sft"),
            {"policy": str(models["policy"])},
            {**data, "train": str(files.sft)},
            3,
            3e-3,
        ),
        "rm": step_loop_stage("rm", run("rm"), {"policy": sft_policy}, {**data, **prefs}, 2, 1e-3),
        algorithm: {
            "run": run(algorithm),
            "model": demo_model(policy=sft_policy, reward=rm_path),
            "data": {**data, "train": str(files.prompts)},
            "generation": gen,
            "reward": {"missing_eos_penalty": -1.0},
            "ppo": rl_section(algorithm, scale),
        },
        "eval": {
            "run": run("eval"),
            "model": demo_model(policy=sft_policy, reward=rm_path),
            "data": {**data, "train": str(files.eval_prompts)},
            "generation": gen,
            "eval": {
                "reference": sft_policy,
                "num_prompts": 128 if not quick else 32,
                "gold_function": GOLD,
            },
        },
    }


# Keys every stage of the demo sets itself (where it writes, which model and data it reads).
DEMO_OWNED = (
    "run.output_dir",
    "run.seed",
    "model.policy",
    "model.reward",
    "data.train",
    "data.eval",
)


def with_overrides(trees: dict, overrides: Sequence[str] = ()) -> dict:
    """Every stage's config tree with the user's `section.key=value` overrides applied.

    All stages share one config schema and each reads only the keys that concern it, so
    an override goes to every stage: generation.* reaches the RL stage and the
    evaluation, model.dtype all of them. The keys that wire the stages together
    (DEMO_OWNED) are refused with an error naming them.
    """
    for override in overrides:
        dotted = override.split("=", 1)[0].strip()
        if dotted in DEMO_OWNED:
            raise ConfigError(
                f"{dotted}: the demo sets it for each stage (use --output-dir, --seed)"
            )
        trees = {name: apply_override(tree, override) for name, tree in trees.items()}
    return trees


def run_demo(
    output_dir: str,
    seed: int = 0,
    quick: bool = False,
    algorithm: str = "ppo",
    overrides: Sequence[str] = (),
    moe: bool = False,
) -> dict:
    """Run the whole demo under output_dir with `algorithm` (one of ALGORITHMS) as the
    alignment stage and `overrides` applied to every stage; returns (and writes)
    DIR/summary.json. moe: a tiny mixture-of-experts policy (task.tiny_moe_policy)."""
    if algorithm in OFFLINE:
        return run_offline_demo(output_dir, algorithm, seed, quick, overrides, moe)
    if algorithm in ITERATIVE:  # its own module, which builds on this one
        raise ValueError("run_demo: the iterative demo is demo.iterative.run_iterative_demo")
    from rlhf_dist.distributed import Runtime
    from rlhf_dist.evaluate import run_eval
    from rlhf_dist.models import quiet_transformers
    from rlhf_dist.trainers.ppo import train_ppo
    from rlhf_dist.trainers.reward import train_reward_model
    from rlhf_dist.trainers.sft import train_sft

    quiet_transformers()
    start = time.time()
    root = Path(output_dir)
    files, models = task_and_models(root, seed, moe)
    trees = with_overrides(stage_configs(root, files, models, seed, quick, algorithm), overrides)
    # distributed.sequence_parallel_size splits SFT and the RL stage; the reward model
    # trains on whole sequences (its stage does not split them)
    trees["rm"] = apply_override(trees["rm"], "distributed.sequence_parallel_size=1")
    trees["rm"] = apply_override(trees["rm"], "lora.enabled=false")  # rm trains in full
    configs = {name: config_from_dict(tree) for name, tree in trees.items()}
    for name, cfg in configs.items():
        validate(cfg, "ppo" if name == algorithm else name, int(os.environ.get("WORLD_SIZE", "1")))
    sp = configs[algorithm].distributed.sequence_parallel_size
    runtime = Runtime(seed=seed, sequence_parallel_size=sp)
    say = runtime.print
    say(f"== demo task written to {files.root}; stage 1/4: SFT")
    train_sft(configs["sft"], runtime)
    say("== stage 2/4: reward model")
    rm = train_reward_model(configs["rm"], runtime)
    say(f"== stage 3/4: {algorithm}")
    train_ppo(configs[algorithm], runtime)
    say(f"== stage 4/4: evaluation of the SFT and {algorithm} policies on held-out prompts")
    sft_eval = run_eval(_with_output(configs["eval"], root / "eval" / "sft"), runtime)
    aligned_cfg = _with_output(
        configs["eval"], root / "eval" / algorithm, policy=str(root / algorithm / "final")
    )
    aligned = run_eval(aligned_cfg, runtime)
    summary = demo_summary(files, rm, sft_eval, {algorithm: aligned}, time.time() - start)
    if runtime.is_main:
        finish(runtime, root, summary, format_summary(summary, root, algorithm))
    return summary


def task_and_models(root: Path, seed: int, moe: bool = False) -> tuple[task.TaskFiles, dict]:
    """The demo task's files under root/task and its tiny models under root/models (moe: a
    mixture-of-experts policy)."""
    files = task.write_task(root / "task", seed=seed)
    tokenizer = task.build_tokenizer(files.tokenizer_dir)
    models = task.build_tiny_models(root / "models", tokenizer, size="tiny", seed=seed, moe=moe)
    return files, models


def finish(runtime: Runtime, root: Path, summary: dict, text: str) -> None:
    """Main process: root/summary.json, the results `text` printed, then the report."""
    (root / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    runtime.print(text)
    from rlhf_dist.observability.report import build_report

    runtime.print(f"   report: {build_report(root)}")


def _with_output(cfg: Config, output_dir: Path, policy: str | None = None) -> Config:
    """cfg with run.output_dir (and model.policy, if given) replaced."""
    from rlhf_dist.config import to_dict

    tree = to_dict(cfg)
    tree["run"]["output_dir"] = str(output_dir)
    if policy:
        tree["model"]["policy"] = policy
    return config_from_dict(tree)


def demo_summary(
    files: task.TaskFiles, rm: dict, sft_eval: dict, aligned: dict, wall: float
) -> dict:
    """summary.json: sft.*, rm.* and NAME.* for each aligned policy in `aligned` (name ->
    its evaluation)."""
    meta = json.loads((files.root / "task.json").read_text())
    rows = [json.loads(line) for line in files.prefs_eval.read_text().splitlines()]
    bayes = task.bayes_accuracy(
        [r["chosen_gold"] for r in rows], [r["rejected_gold"] for r in rows], meta["beta"]
    )

    def pick(ev: dict) -> dict:
        return {k: ev[k] for k in ("gold_reward", "score", "kl_to_ref", "length", "eos_rate")}

    return {
        "sft": pick(sft_eval),
        "rm": {
            "eval_accuracy": rm["eval_accuracy"],
            "bayes_accuracy": bayes,
            "eval_ece": rm["eval_ece"],
        },
        **{name: pick(ev) for name, ev in aligned.items()},
        "wall_seconds": round(wall, 1),
    }


def format_summary(s: dict, root: Path, algorithm: str = "ppo") -> str:
    name, a = algorithm.upper(), s[algorithm]
    lines = [
        "",
        "== demo results (held-out prompts; gold = the task's true reward in [0, 1])",
        f"   gold reward   SFT {s['sft']['gold_reward']:.3f}  ->  {name} {a['gold_reward']:.3f}",
        f"   RM score      SFT {s['sft']['score']:.3f}  ->  {name} {a['score']:.3f}",
        f"   KL to SFT     {name} {a['kl_to_ref']:.2f} nats per response",
        f"   RM accuracy   {s['rm']['eval_accuracy']:.3f} (Bayes-optimal under the label noise: {s['rm']['bayes_accuracy']:.3f})",
        f"   wall time     {s['wall_seconds']:.0f} s",
        f"   summary: {root / 'summary.json'}; samples: {root / 'eval' / algorithm / 'samples.jsonl'}",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------ offline preference algorithms

GOLD_AS_SCORE = "rlhf_dist.demo.task:gold_reward_fn"


# The stage each offline algorithm runs: SimPO and ORPO are `rlhf-dist dpo` losses.
OFFLINE_STAGES = {"dpo": "dpo", "kto": "kto", "simpo": "dpo", "orpo": "dpo"}
assert tuple(OFFLINE_STAGES) == OFFLINE


def offline_stage_config(root: Path, files: task.TaskFiles, seed: int, algorithm: str) -> dict:
    """The config tree of `rlhf-dist dpo` / `kto` from the SFT policy on the demo's preference
    pairs (KTO reads them as desirable chosen / undesirable rejected completions; simpo and
    orpo are dpo with that loss_type). Numbers tuned for a 2-core CPU: docs/demo.md,
    "Algorithms on the demo"."""
    section = {
        "dpo": {"beta": 0.1, "optim": {"lr": 2e-4}},
        "kto": {"beta": 0.1, "optim": {"lr": 1e-4}},
        "simpo": {"loss_type": "simpo", "beta": 2.5, "simpo_gamma": 0.5, "optim": {"lr": 3e-4}},
        "orpo": {"loss_type": "orpo", "beta": 1.0, "optim": {"lr": 5e-4}},
    }[algorithm]
    return {
        "run": {"output_dir": str(root / algorithm), "seed": seed, "log_every": 10},
        "model": demo_model(policy=str(root / "sft" / "final")),
        "data": {"max_prompt_length": 16, "max_length": 48, "train": str(files.prefs_train)},
        OFFLINE_STAGES[algorithm]: {
            "epochs": 1,
            "batch_size": 32,
            "micro_batch_size": 32,
            **section,
        },
    }


def run_offline_demo(
    output_dir: str,
    algorithm: str,
    seed: int = 0,
    quick: bool = False,
    overrides: Sequence[str] = (),
    moe: bool = False,
) -> dict:
    """SFT -> dpo, kto, simpo or orpo -> eval of both policies; writes DIR/summary.json with
    `sft.*` and `<algorithm>.*` (gold reward, KL to the SFT policy, ...). No reward model: the
    evaluation's score is the gold reward itself (eval.gold_function adds the EOS rule)."""
    from rlhf_dist.distributed import Runtime
    from rlhf_dist.evaluate import run_eval
    from rlhf_dist.models import quiet_transformers
    from rlhf_dist.trainers.dpo import train_dpo
    from rlhf_dist.trainers.kto import train_kto
    from rlhf_dist.trainers.sft import train_sft

    quiet_transformers()
    start, root = time.time(), Path(output_dir)
    files, configs = offline_demo_configs(root, algorithm, seed, quick, overrides, moe)
    runtime = Runtime(seed=seed)
    runtime.print(f"== demo task written to {files.root}; stage 1/3: SFT")
    train_sft(configs["sft"], runtime)
    runtime.print(f"== stage 2/3: {algorithm.upper()} on the preference pairs")
    {"dpo": train_dpo, "kto": train_kto}[OFFLINE_STAGES[algorithm]](configs[algorithm], runtime)
    runtime.print("== stage 3/3: evaluation of the SFT and trained policies on held-out prompts")
    evals = {"sft": run_eval(_with_output(configs["eval"], root / "eval" / "sft"), runtime)}
    trained = str(root / algorithm / "final")
    eval_cfg = _with_output(configs["eval"], root / "eval" / algorithm, policy=trained)
    evals[algorithm] = run_eval(eval_cfg, runtime)
    keys = ("gold_reward", "score", "kl_to_ref", "length", "eos_rate")
    summary: dict[str, Any] = {name: {k: ev[k] for k in keys} for name, ev in evals.items()}
    summary |= {"algorithm": algorithm, "wall_seconds": round(time.time() - start, 1)}
    if runtime.is_main:
        finish(runtime, root, summary, _offline_results(root, summary, algorithm))
    return summary


def offline_demo_configs(
    root: Path,
    algorithm: str,
    seed: int,
    quick: bool,
    overrides: Sequence[str] = (),
    moe: bool = False,
) -> tuple[task.TaskFiles, dict[str, Config]]:
    """The task files (written under root/task, tiny models under root/models; moe: a
    mixture-of-experts policy) and the validated configs of the offline demo's sft,
    `algorithm` and eval stages."""
    files, models = task_and_models(root, seed, moe)
    trees = stage_configs(root, files, models, seed, quick)
    trees["eval"]["model"].pop("reward")
    trees["eval"]["reward"] = {"function": GOLD_AS_SCORE}
    trees[algorithm] = offline_stage_config(root, files, seed, algorithm)
    trees = with_overrides(trees, overrides)
    configs = {name: config_from_dict(trees[name]) for name in ("sft", algorithm, "eval")}
    for name, cfg in configs.items():
        validate(cfg, OFFLINE_STAGES.get(name, name))
    return files, configs


def _offline_results(root: Path, summary: dict, algorithm: str) -> str:
    sft, new = summary["sft"], summary[algorithm]
    return (
        f"\n== demo results (held-out prompts; gold = the task's true reward in [0, 1])\n"
        f"   gold reward   SFT {sft['gold_reward']:.3f}  ->  {algorithm.upper()} {new['gold_reward']:.3f}\n"
        f"   KL to SFT     {algorithm.upper()} {new['kl_to_ref']:.2f} nats per response\n"
        f"   wall time     {summary['wall_seconds']:.0f} s\n"
        f"   summary: {root / 'summary.json'}"
    )
