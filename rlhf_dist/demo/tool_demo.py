"""`rlhf-dist demo --task tool_use --algorithm grpo`: SFT on tool demonstrations, then GRPO
with the `lookup` tool, then both policies evaluated on held-out prompts (docs/agents.md).

The answer to "what is the code of KEY ?" is in a table only the tool sees
(demo/tool_task.py). Half the demonstrations call the tool, half guess, so the SFT policy
is right about 1/2 + 1/12 of the time. summary.json: `sft.gold_reward`,
`grpo.gold_reward` (exact-answer rate on the held-out keys' prompts) and
`*.tool_calls_per_response`.

The figures it reaches: docs/agents.md, "The tool-use demo".

`endpoint="function"` (`--through-endpoint`): the GRPO stage's environment drives the
policy itself through the OpenAI-compatible chat endpoint of a `rlhf-dist serve` process
started here (tool_task.endpoint_episode; generation.environment_endpoint), as an
environment library would; the trainer trains on the ids the server recorded.
`endpoint="verifiers"` (`--verifiers`): the environment is the task written as a
verifiers ToolEnv (demo/tool_verifiers.py), which also supplies the GRPO prompts. The
server batches the episodes' concurrent turns (serve.batch_window_ms).
`endpoint="served"` (`--served`): the episodes and the tool stay in the trainer's process
and every turn is sampled by the server (generation.backend=server), so that
ppo.max_staleness=k plays the next k iterations' episodes while one trains.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rlhf_dist.config import Config, config_from_dict, validate
from rlhf_dist.demo import task, tool_task
from rlhf_dist.demo.pipeline import _with_output, demo_model, with_overrides
from rlhf_dist.generation.server import wait_healthy

if TYPE_CHECKING:  # torch loads when a stage runs
    from rlhf_dist.distributed import Runtime

TOOLS = ["rlhf_dist.demo.tool_task:lookup"]
REWARD = "rlhf_dist.demo.tool_task:answer_reward"
GOLD = "rlhf_dist.demo.tool_task:gold_eval"


def tool_stage_configs(root: Path, files: dict, policy: Path, seed: int, quick: bool) -> dict:
    """The config trees of the three stages (numbers tuned for a 2-core CPU)."""
    data = {"max_prompt_length": 32, "max_length": 64}
    gen = {"max_new_tokens": 16, "temperature": 0.7, "tools": TOOLS, "max_turns": 3}
    sft_policy = str(root / "sft" / "final")

    def run(name: str, every: int = 10) -> dict:
        return {"output_dir": str(root / name), "seed": seed, "log_every": every}

    return {
        "sft": {
            "run": run("sft"),
            "model": demo_model(policy=str(policy)),
            "data": {**data, "train": str(files["sft"])},
            "sft": {
                "epochs": 2 if quick else 40,
                "batch_size": 16,
                "micro_batch_size": 16,
                "optim": {"lr": 3e-3, "schedule": "cosine", "warmup_steps": 5},
            },
        },
        "grpo": {
            "run": run("grpo", 2),
            "model": demo_model(policy=sft_policy),
            "data": {**data, "train": str(files["prompts"])},
            "generation": gen,
            "reward": {"function": REWARD},
            "ppo": {
                "iterations": 3 if quick else 30,
                "estimator": "grpo",
                "rollout_batch_size": 8,
                "samples_per_prompt": 4,
                "rollout_micro_batch_size": 32,
                "ppo_epochs": 1,
                "minibatch_size": 16,
                "micro_batch_size": 16,
                "optim": {"lr": 3e-4},
                "kl_coef": 0.05,
            },
        },
        "eval": {
            "run": run("eval"),
            "model": demo_model(policy=sft_policy),
            "data": {**data, "train": str(files["eval_prompts"])},
            "generation": gen,
            "reward": {"function": REWARD},
            "eval": {"num_prompts": 64, "gold_function": GOLD},
        },
    }


TOKEN_ENV = "RLHF_DIST_DEMO_SERVER_TOKEN"


@contextlib.contextmanager
def served(policy: Path, root: Path, port: int) -> Iterator[str]:
    """A `rlhf-dist serve` process of `policy` on 127.0.0.1:`port` with a fresh token in
    TOKEN_ENV (this process's environment too); its URL once /health answers."""
    os.environ[TOKEN_ENV] = secrets.token_hex(16)
    config = root / "serve.json"
    tree = {
        "model": {"policy": str(policy)},
        "perf": {"num_threads": 1},
        "serve": {"port": port, "token_env": TOKEN_ENV, "batch_window_ms": 20},
    }
    config.write_text(json.dumps(tree), encoding="utf-8")
    log = (root / "serve.log").open("w")
    cmd = [sys.executable, "-m", "rlhf_dist", "serve", "--config", str(config)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_healthy(url, 300, lambda: proc.poll() is None):
            raise RuntimeError(f"rlhf-dist serve did not start: see {root / 'serve.log'}")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


ENVIRONMENTS = {
    "function": "rlhf_dist.demo.tool_task:endpoint_episode",
    "verifiers": "verifiers:rlhf_dist.demo.tool_verifiers",
}


def through_endpoint(tree: dict, url: str, environment: str = "function") -> dict:
    """The GRPO stage's tree with its environment (ENVIRONMENTS) playing through the
    server's endpoint; a verifiers environment's dataset is the prompts too (the same RL
    keys as the task's prompts file, at the run's seed)."""
    spec = ENVIRONMENTS[environment]
    gen = {k: v for k, v in tree["generation"].items() if k != "tools"}
    gen |= {
        "backend": "server",
        "server_urls": [url],
        "server_token_env": TOKEN_ENV,
        "environment": spec,
        "environment_endpoint": True,
    }
    data = tree["data"]
    if environment == "verifiers":
        data = data | {"train": f"{spec}?seed={tree['run']['seed']}"}
        gen["environment"] = data["train"]
    return tree | {"generation": gen, "data": data}


def served_turns(tree: dict, url: str) -> dict:
    """The GRPO stage's tree with every turn sampled by the server at `url`; the episodes
    and the tool stay in this process."""
    gen = tree["generation"] | {
        "backend": "server",
        "server_urls": [url],
        "server_token_env": TOKEN_ENV,
    }
    return tree | {"generation": gen}


def grpo_with_server(tree: dict, url: str, endpoint: str) -> dict:
    """The GRPO stage's tree for `endpoint` ("served": `served_turns`; an environment of
    ENVIRONMENTS: `through_endpoint`) against the server at `url`."""
    return (
        served_turns(tree, url) if endpoint == "served" else through_endpoint(tree, url, endpoint)
    )


def run_tool_demo(
    output_dir: str,
    seed: int = 0,
    quick: bool = False,
    overrides: Sequence[str] = (),
    endpoint: str = "",
) -> dict:
    """SFT -> GRPO with the tool -> eval of both; returns (and writes) DIR/summary.json.
    endpoint ("function" or "verifiers"): GRPO's environment talks to a rollout server's
    chat endpoint; "served": the server samples the turns of the trainer's episodes
    (module doc); "": the tool runs in the trainer's episodes, sampled in process."""
    from rlhf_dist.distributed import Runtime
    from rlhf_dist.models import quiet_transformers
    from rlhf_dist.trainers.ppo import train_ppo
    from rlhf_dist.trainers.sft import train_sft

    quiet_transformers()
    start, root = time.time(), Path(output_dir)
    files = tool_task.write_tool_task(root / "task", seed=seed)
    tokenizer = tool_task.build_tool_tokenizer(root / "task" / "tokenizer")
    policy = task.build_tiny_models(root / "models", tokenizer, size="tiny", seed=seed)["policy"]
    trees = with_overrides(tool_stage_configs(root, files, policy, seed, quick), overrides)
    configs = validated_configs(trees, endpoint)
    runtime = Runtime(seed=seed)
    runtime.print(f"== tool-use task written to {root / 'task'}; stage 1/3: SFT")
    train_sft(configs["sft"], runtime)
    if endpoint:
        from rlhf_dist.distributed.weight_sync import free_port

        how = "the environment driving a rollout server's chat endpoint"
        if endpoint == "served":
            how = "the lookup tool, every turn sampled by a rollout server"
        runtime.print(f"== stage 2/3: GRPO, {how}")
        with served(root / "sft" / "final", root, free_port()) as url:
            train_ppo(config_from_dict(grpo_with_server(trees["grpo"], url, endpoint)), runtime)
    else:
        runtime.print("== stage 2/3: GRPO with the lookup tool")
        train_ppo(configs["grpo"], runtime)
    runtime.print("== stage 3/3: evaluation of the SFT and GRPO policies on held-out keys")
    summary = evaluated(configs["eval"], root, runtime)
    summary["wall_seconds"] = round(time.time() - start, 1)
    if runtime.is_main:
        (root / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        s, g = summary["sft"], summary["grpo"]
        runtime.print(
            f"== tool-use demo: gold SFT {s['gold_reward']:.3f} -> GRPO {g['gold_reward']:.3f}; "
            f"tool calls per response {s['tool_calls_per_response']:.2f} -> "
            f"{g['tool_calls_per_response']:.2f}; {summary['wall_seconds']:.0f} s"
        )
    return summary


def validated_configs(trees: dict, endpoint: str) -> dict:
    """Each stage's Config, validated before anything trains; the GRPO stage as it will
    run (through the endpoint: the server's URL is known only once it starts, so a stand-in
    here), so that e.g. ppo.max_staleness=1, which needs the server, is checked as such."""
    configs = {name: config_from_dict(tree) for name, tree in trees.items()}
    for name, cfg in configs.items():
        if name == "grpo" and endpoint:
            cfg = config_from_dict(grpo_with_server(trees[name], "http://127.0.0.1:1", endpoint))
        validate(cfg, "ppo" if name == "grpo" else name)
    return configs


def evaluated(eval_cfg: Config, root: Path, runtime: Runtime) -> dict:
    """Gold reward, tool calls and turns per response of the SFT and GRPO policies on the
    held-out prompts."""
    from rlhf_dist.evaluate import run_eval

    summary = {}
    for name, policy in (("sft", None), ("grpo", str(root / "grpo" / "final"))):
        ev = run_eval(_with_output(eval_cfg, root / "eval" / name, policy), runtime)
        summary[name] = {
            "gold_reward": ev["gold_reward"],
            "tool_calls_per_response": ev["tool_calls"],
            "turns": ev["turns"],
        }
    return summary
