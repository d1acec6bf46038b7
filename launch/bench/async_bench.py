"""Rollouts served ahead (ppo.max_staleness; docs/serving.md), one mode per subcommand;
async_tail.sh runs it (and installs the real SmolLM2 the first three need):

  overlap  s/iteration of the same GRPO work on-policy (max_staleness 0) and one step off
           (1) against a rollout server, and how much generation and training overlap
  demo     does one-step-off-policy training learn the offline demo as well as on-policy?
  serve    what a weight sync and a served rollout cost against in-process generation
  routing  routing replay on a tiny Qwen3-MoE served in bf16 to an fp32 trainer: the
           sampler-vs-trainer log-prob gap and routing-flip rate with R3 against none
           (docs/moe.md, "Routing replay")
  tail     trained tokens/s on heavy-tailed response lengths: sync, k = 1, k = 4, k = 4
           partial; the trained lengths against the sync run's and the task's exact law
  parity   do the text demo's GRPO and the arithmetic task learn as well with k = 4 and
           partial rollouts as synchronously, seed by seed?
  http     request overhead of the servers' client: httpx (pooled) against urllib

Usage: python launch/bench/async_bench.py MODE [ARGS...]   (each MODE's --help)
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from harness import TOKEN_ENV, start_server
from suite import SETTINGS, run_config

from rlhf_dist.api import end_process
from rlhf_dist.config import config_from_dict
from rlhf_dist.data.rows import left_pad
from rlhf_dist.demo import arithmetic_demo, pipeline, smollm2, task
from rlhf_dist.distributed.weight_sync import free_port
from rlhf_dist.engine.decode import generate
from rlhf_dist.models import quiet_transformers
from rlhf_dist.models.loading import load_causal_lm, load_tokenizer, policy_stop_ids

# ==============================================================================================
# overlap: seconds per iteration on- and off-policy, and the overlap
# Bounded-staleness rollouts (ppo.max_staleness; docs/serving.md, "Asynchronous rollouts"):
# seconds per iteration of the same GRPO work with on-policy rollouts from a rollout server
# (max_staleness=0) and one step off-policy (1), and how much of generation and training
# overlap.
#
# The work: the arithmetic demo's GRPO stage in its quick size (the real SmolLM2-135M, a
# reasoning-gym task, PROMPTS x SAMPLES responses of up to NEW tokens, one optimizer step
# per rollout), ITERATIONS iterations, with one `rlhf-dist serve` process of the same model
# and one trainer process, THREADS threads each. Both runs start from the same weights and
# seed against a freshly started server.
#
# Per iteration (the first dropped: start-up), medians from each run's metrics.jsonl:
# - t_generate = the sync run's time/generate - time/weight_sync (the servers' rollout,
#   waited for);
# - t_train = the sync run's time/score + time/update + time/weight_sync (the trainer's
#   own work; a weight sync cannot overlap a request);
# - t_iteration = the async run's time/total;
# - overlap = (t_generate + t_train - t_iteration) / min(t_generate, t_train): 1 when the
#   shorter one is fully hidden behind the longer, 0 when the async run is no faster than
#   the sync one, negative when it is slower (the two compete for the same cores).
# The components come from the sync run because they are the work's own durations: in the
# async run generation and training run at once and slow each other where they share cores.
# The async run's own time/generate (what the trainer still waited) and
# time/generate_request (the servers' seconds, in the background) are printed beside them.
#
# Both processes share the machine's cores: on a 2-core box keep THREADS at 1.
#
# `--environment` plays the same prompts as two-turn episodes of an environment that drives
# the policy through the server's chat endpoint (`chat_episode` below;
# generation.environment_endpoint): the answer, then "check it", the last number of the
# second answer scored. One step off, the next iteration's episodes play on the trainer's
# threads while it trains.
#
# `--suite OUT` runs the scale suite's PPO work instead (launch/bench/suite.py's `plain` over
# the models `suite.py prepare` built in OUT, a critic and a reward model; the GPU case of
# launch/bench/gpu_suite.sh, `async`): on one GPU the server and the trainer share it, so
# the overlap measures how much of generation hides behind training on the same device.
#
# Usage: bash launch/bench/async_tail.sh overlap [--iterations 6] [--threads 1] [--new 24]
#        [--out runs/bench/async] [--environment [--window MS] | --suite OUT]


def grpo_tree(out: Path, policy: Path, url: str, args, staleness: int) -> dict:
    tree = arithmetic_demo.arithmetic_stage_configs(out, policy, seed=0, quick=True)["grpo"]
    tree["run"] |= {"output_dir": str(out / f"staleness{staleness}"), "progress": False}
    tree["generation"] |= {"backend": "server", "server_urls": [url],
                           "server_token_env": TOKEN_ENV, "max_new_tokens": args.new}  # fmt: skip
    tree["ppo"] |= {"iterations": args.iterations, "max_staleness": staleness}
    tree["perf"] = {"num_threads": args.threads}
    return tree


def chat_episode(client, prompt) -> None:
    """The environment of `--environment`: the task's question, then a request to check
    the answer; None: reward.function scores the second answer."""
    messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    for follow_up in ("Check your answer, then give it again as a number.", None):
        messages.append(client.chat(messages)["choices"][0]["message"])
        if follow_up is None:
            return None
        messages.append({"role": "user", "content": follow_up})
    return None


def environment_tree(out: Path, policy: Path, url: str, args, staleness: int) -> dict:
    """`--environment`: grpo_tree's work played as chat_episode's two-turn episodes."""
    tree = grpo_tree(out, policy, url, args, staleness)
    tree["generation"] |= {"environment": "async_bench:chat_episode",
                           "environment_endpoint": True, "max_turns": 2}  # fmt: skip
    return tree


def suite_tree(out: Path, policy: Path, url: str, args, staleness: int, suite: Path) -> dict:
    """The scale suite's `plain` PPO run (GPU settings on a GPU) against the server."""
    tree = run_config(suite, "plain", device(), args.iterations)
    tree["run"] |= {"output_dir": str(out / f"staleness{staleness}")}
    tree["generation"] |= {"backend": "server", "server_urls": [url],
                           "server_token_env": TOKEN_ENV}  # fmt: skip
    tree["ppo"] |= {"max_staleness": staleness}
    tree["perf"] = {"num_threads": args.threads}
    return tree


def device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def train(tree: dict, workdir: Path, threads: int, kill_after: int = 0) -> list[dict]:
    """Run the GRPO stage in its own process -> its metrics rows. kill_after > 0: SIGKILL
    the process once its metrics log that iteration, then run it again with
    run.resume=auto to the end (the resume cuts the metrics back to its checkpoint, so the
    rows log every iteration once)."""
    config = workdir / f"{Path(tree['run']['output_dir']).name}.yaml"
    config.write_text(json.dumps(tree))
    here = str(Path(__file__).resolve().parent)  # chat_episode, for --environment
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    env = os.environ | {"OMP_NUM_THREADS": str(threads), "PYTHONPATH": path}
    cmd = [sys.executable, "-m", "rlhf_dist", "ppo", "--config", str(config)]
    metrics = Path(tree["run"]["output_dir"]) / "metrics.jsonl"
    if kill_after:
        process = subprocess.Popen(cmd, env=env)
        steps = lambda: [r["step"] for r in iteration_rows(metrics)]  # noqa: E731
        while process.poll() is None and max(steps(), default=0) < kill_after:
            time.sleep(0.2)
        process.kill()  # SIGKILL: no handler runs, nothing is flushed
        if process.wait() != -9:
            raise SystemExit(f"the trainer ended before iteration {kill_after}: not killed")
        print(f"SIGKILLed after iteration {max(steps())}; resuming", file=sys.stderr)
        resumed = copy.deepcopy(tree)
        resumed["run"]["resume"] = "auto"
        config.write_text(json.dumps(resumed))
    subprocess.run(cmd, env=env, check=True)
    return iteration_rows(metrics)


def iteration_rows(metrics: Path) -> list[dict]:
    """The iteration rows of a run's metrics.jsonl (none while it has none)."""
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    return [r for r in map(json.loads, lines) if "time/total" in r]


def medians(rows: list[dict]) -> dict[str, float]:
    """Median seconds per iteration over rows[1:] (the first: start-up) and the mean score."""
    steady = rows[1:] or rows

    def median(key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in steady)

    keys = ("time/total", "time/generate", "time/weight_sync", "time/score", "time/update",
            "time/generate_request")  # fmt: skip
    out = {key: median(key) for key in keys}
    return out | {"score": statistics.mean(r["objective/score"] for r in rows)}


def overlap(sync: dict[str, float], asynchronous: dict[str, float]) -> tuple[float, float, float]:
    """(t_generate, t_train, overlap) of the module docstring."""
    t_generate = sync["time/generate"] - sync["time/weight_sync"]
    t_train = sync["time/score"] + sync["time/update"] + sync["time/weight_sync"]
    hidden = t_generate + t_train - asynchronous["time/total"]
    return t_generate, t_train, hidden / min(t_generate, t_train)


def overlap_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        description='Bounded-staleness rollouts (ppo.max_staleness; docs/serving.md, "Asynchronous rollouts"):'
    )
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--new", type=int, default=24, help="max new tokens per response")
    parser.add_argument("--out", default="runs/bench/async")
    parser.add_argument("--suite", help="the scale suite's OUT: its PPO work instead")
    parser.add_argument(
        "--environment",
        action="store_true",
        help="two-turn episodes of an environment through the chat endpoint",
    )
    parser.add_argument(
        "--window", type=float, default=0.0, help="the server's serve.batch_window_ms"
    )
    args = parser.parse_args(argv)
    os.environ.setdefault(TOKEN_ENV, os.urandom(16).hex())
    out = Path(args.out).resolve()
    if args.suite:
        policy, work = Path(args.suite).resolve() / "policy", f"PPO on {args.suite}'s policy"
        dtype, make = (
            SETTINGS[device()]["dtype"],
            functools.partial(suite_tree, suite=Path(args.suite).resolve()),
        )
    else:
        policy, work = smollm2.build("shipped"), "GRPO on SmolLM2-135M"
        dtype, make = "float32", grpo_tree
        if args.environment:
            work, make = f"{work}, two-turn episodes through the chat endpoint", environment_tree
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for staleness in (0, 1):
            port = free_port()
            server = start_server(policy, port, args.threads, Path(tmp), dtype, args.window)
            try:
                tree = make(out, policy=policy, url=f"http://127.0.0.1:{port}", args=args,
                            staleness=staleness)  # fmt: skip
                results[staleness] = medians(train(tree, Path(tmp), args.threads))
            finally:
                server.terminate()
                server.wait(timeout=60)
    print(f"{work} ({device()}), one trainer + one server process, {args.threads} thread(s) "
          f"each, serve.batch_window_ms {args.window:g}, {args.iterations} iterations (first "
          f"dropped), medians in seconds")  # fmt: skip
    print(f"{'ppo.max_staleness':<18} {'s/iteration':>11} {'waited':>7} {'request':>8} "
          f"{'sync':>6} {'score':>6} {'update':>7} {'mean score':>10}")  # fmt: skip
    for staleness, t in results.items():
        print(f"{staleness:<18} {t['time/total']:11.2f} {t['time/generate']:7.2f} "
              f"{t['time/generate_request']:8.2f} {t['time/weight_sync']:6.2f} "
              f"{t['time/score']:6.2f} {t['time/update']:7.2f} {t['score']:10.3f}")  # fmt: skip
    t_generate, t_train, hidden = overlap(results[0], results[1])
    speedup = results[0]["time/total"] / results[1]["time/total"]
    print(f"t_generate {t_generate:.2f}, t_train {t_train:.2f} (sync run), t_iteration "
          f"{results[1]['time/total']:.2f} (async run): overlap {hidden:.2f}; speed-up of "
          f"max_staleness=1: {speedup:.2f}x")  # fmt: skip


# ==============================================================================================
# demo: does one-step-off-policy training learn the demo as well?
# Does one-step-off-policy training learn the demo as well as on-policy training? The
# offline demo's PPO stage (demo/pipeline.py stage_configs: PPO with a critic against the
# demo's reward model) run three ways from the same SFT policy and reward model, trained
# once: colocated generation (the demo as shipped), rollouts from a `rlhf-dist serve`
# process on-policy (ppo.max_staleness=0) and one step off-policy (1). Each final policy is
# evaluated as the demo evaluates it (held-out prompts, gold reward, KL to the SFT policy);
# the off-policy run's logged staleness shows no rollout older than one update was trained
# on (docs/serving.md, "Asynchronous rollouts").
#
# `--ranks 2`: the PPO stage runs as 2 CPU ranks under ZeRO-3 (`accelerate launch` with
# accelerate_configs/cpu_zero3.yaml, gloo), each rank sampling its shard through the server.
#
# Usage: bash launch/bench/async_tail.sh demo [--seeds 0 1] [--ranks 1|2] [--out runs/bench/async_demo]


REPO = Path(__file__).resolve().parents[2]


MODES = {"colocated": None, "served, max_staleness 0": 0, "served, max_staleness 1": 1}


def ppo_tree(trees: dict, root: Path, name: str, url: str, staleness: int | None) -> dict:
    tree = copy.deepcopy(trees["ppo"])
    tree["run"]["output_dir"] = str(root / name)
    if staleness is not None:
        tree["generation"] |= {"backend": "server", "server_urls": [url],
                               "server_token_env": TOKEN_ENV}  # fmt: skip
        tree["ppo"]["max_staleness"] = staleness
    return tree


def demo_train(tree: dict, ranks: int, runtime) -> None:
    """The PPO stage in this process, or as `ranks` ZeRO-3 CPU ranks."""
    from rlhf_dist.trainers.ppo import train_ppo

    if ranks == 1:
        train_ppo(config_from_dict(tree), runtime)
        return
    p = tree["ppo"]  # each rank's micro-batches: its share of a minibatch (same loss)
    p["micro_batch_size"] = min(p["micro_batch_size"], p["minibatch_size"] // ranks)
    config = Path(tree["run"]["output_dir"] + ".json")
    config.write_text(json.dumps(tree))
    cmd = [sys.executable, "-m", "accelerate.commands.launch",
           "--config_file", str(REPO / "accelerate_configs" / "cpu_zero3.yaml"),
           "--num_processes", str(ranks), "--main_process_port", str(free_port()),
           "-m", "rlhf_dist", "ppo", "--config", str(config)]  # fmt: skip
    subprocess.run(cmd, env=os.environ | {"OMP_NUM_THREADS": "1"}, check=True)


def one_seed(root: Path, seed: int, ranks: int) -> dict:
    """SFT and RM once, then the PPO stage each way and its evaluation -> figures."""
    from rlhf_dist.distributed import Runtime
    from rlhf_dist.evaluate import run_eval
    from rlhf_dist.trainers.reward import train_reward_model
    from rlhf_dist.trainers.sft import train_sft

    files, models = pipeline.task_and_models(root, seed)  # deterministic per seed
    trees = pipeline.stage_configs(root, files, models, seed, quick=False, algorithm="ppo")
    runtime = Runtime(seed=seed)
    train_sft(config_from_dict(trees["sft"]), runtime)
    train_reward_model(config_from_dict(trees["rm"]), runtime)
    evaluate = config_from_dict(trees["eval"])
    figures = {
        "SFT": {
            "gold": run_eval(pipeline._with_output(evaluate, root / "eval_sft"), runtime)[
                "gold_reward"
            ]
        }
    }
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        server = start_server(root / "sft" / "final", port, 1, Path(tmp))
        try:
            for i, (mode, staleness) in enumerate(MODES.items()):
                name = f"ppo_{i}"
                start = time.perf_counter()
                url = f"http://127.0.0.1:{port}"
                demo_train(ppo_tree(trees, root, name, url, staleness), ranks, runtime)
                seconds = time.perf_counter() - start
                ev = run_eval(
                    pipeline._with_output(
                        evaluate, root / f"eval_{name}", str(root / name / "final")
                    ),
                    runtime,
                )
                rows = [
                    json.loads(line)
                    for line in (root / name / "metrics.jsonl").read_text().splitlines()
                ]
                stale = max((r.get("rollout/staleness_max", 0.0) for r in rows), default=0.0)
                figures[mode] = {"gold": ev["gold_reward"], "kl": ev["kl_to_ref"],
                                 "seconds": seconds, "staleness_max": stale}  # fmt: skip
        finally:
            server.terminate()
            server.wait(timeout=60)
    return figures


def demo_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        description="Does one-step-off-policy training learn the demo as well as on-policy training? The"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--ranks", type=int, default=1, choices=(1, 2))
    parser.add_argument("--out", default="runs/bench/async_demo")
    args = parser.parse_args(argv)
    os.environ.setdefault(TOKEN_ENV, os.urandom(16).hex())
    out = Path(args.out).resolve()
    results = {seed: one_seed(out / f"seed{seed}", seed, args.ranks) for seed in args.seeds}
    print(f"The offline demo's PPO stage ({args.ranks} rank(s)) from the same SFT policy and "
          "reward model; held-out gold")  # fmt: skip
    print(f"{'seed':>4} {'way':<26} {'gold':>6} {'KL':>6} {'seconds':>8} {'staleness max':>13}")
    for seed, figures in results.items():
        print(f"{seed:>4} {'SFT':<26} {figures['SFT']['gold']:6.3f}")
        for mode in MODES:
            f = figures[mode]
            print(f"{seed:>4} {mode:<26} {f['gold']:6.3f} {f['kl']:6.2f} {f['seconds']:8.1f} "
                  f"{f['staleness_max']:13.0f}")  # fmt: skip


# ==============================================================================================
# serve: what a weight sync and a served rollout cost
# The rollout server on the real SmolLM2-135M (docs/serving.md): what a weight sync and a
# served rollout cost against in-process generation, on this machine.
#
# Starts `rlhf-dist serve` on SmolLM2-135M-Instruct (fp32, perf.num_threads threads) on a
# free port, then in this process, as trainer rank 0 would (generation/server.py):
#
# 1. the first sync (joining the weight-sync group, then every weight as version 1) and
#    REPEATS more syncs, each with generation.server_sync_bucket_mb = BUCKET MiB, the
#    post-sync check included: seconds each, and this process's peak RSS growth;
# 2. PROMPTS chat prompts x NEW tokens (temperature 0.7): served (POST /generate, one server)
#    and in-process (the same decode loop and threads here), median of REPEATS seconds.
#
# Both processes share the machine's cores: on a 2-core box the figures are an upper bound
# of what a server on its own cores costs. Prints one table.
#
# Usage: bash launch/bench/async_tail.sh serve [--threads 1] [--bucket 64] [--prompts 8] [--new 32]
#        [--repeats 3]


QUESTIONS = ["What is a good review?", "Name a fruit.", "Say hello.", "Count to three."]


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def bench_syncs(engine, actor, repeats: int) -> list[tuple[str, float, float]]:
    rows = []
    for i in range(repeats + 1):
        with torch.no_grad():  # a new version each time, as after an optimizer step
            next(actor.parameters()).add_(1e-4)
        rss, start = peak_rss_mib(), time.perf_counter()
        engine.load_weights(actor)
        label = "first sync (join + send + check)" if i == 0 else f"sync {i} (send + check)"
        rows.append((label, time.perf_counter() - start, peak_rss_mib() - rss))
    return rows


def bench_generation(engine, actor, tokenizer, gen, stops, n_prompts: int, repeats: int):
    chats = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(n_prompts)]
    texts = [
        tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats
    ]
    seqs = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    ids, mask = left_pad(seqs, tokenizer.pad_token_id)
    served, local = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.generate(ids, mask, gen, stops, tokenizer.pad_token_id)
        served.append(time.perf_counter() - start)
        start = time.perf_counter()
        generate(actor, ids, mask, gen, tokenizer, None, stops)
        local.append(time.perf_counter() - start)
    return statistics.median(served), statistics.median(local)


def serve_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        description="The rollout server on the real SmolLM2-135M (docs/serving.md): what a weight sync and a"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--bucket", type=float, default=64.0, help="MiB per sync bucket")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new", type=int, default=32, help="new tokens per response")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    quiet_transformers()
    torch.set_num_threads(args.threads)
    os.environ.setdefault(TOKEN_ENV, os.urandom(16).hex())
    model_dir, port = smollm2.build("shipped"), free_port()
    cfg = config_from_dict(
        {"model": {"policy": str(model_dir)},
         "generation": {"backend": "server", "server_urls": [f"http://127.0.0.1:{port}"],
                        "server_token_env": TOKEN_ENV, "server_sync_bucket_mb": args.bucket,
                        "max_new_tokens": args.new, "min_new_tokens": args.new,
                        "temperature": 0.7}}
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(model_dir, port, args.threads, Path(tmp))
        try:
            actor = load_causal_lm(str(model_dir), "model.policy").eval()
            tokenizer = load_tokenizer(str(model_dir))
            from rlhf_dist.generation.server import ServerEngine

            engine = ServerEngine(cfg, is_main=True, any_rank=lambda flag: flag)
            syncs = bench_syncs(engine, actor, args.repeats)
            stops = policy_stop_ids(cfg, tokenizer)
            served, local = bench_generation(
                engine, actor, tokenizer, cfg.generation, stops, args.prompts, args.repeats
            )
        finally:
            server.terminate()
            server.wait(timeout=60)
    mib = sum(p.numel() * p.element_size() for p in actor.parameters()) / 2**20
    print(f"SmolLM2-135M fp32, {mib:.0f} MiB of weights, buckets of {args.bucket:g} MiB, "
          f"{args.threads} thread(s) per process")  # fmt: skip
    print(f"{'what':<44} {'seconds':>8} {'peak RSS growth MiB':>20}")
    for label, seconds, rss in syncs:
        print(f"{label:<44} {seconds:8.2f} {rss:20.0f}")
    what = f"{args.prompts} prompts x {args.new} tokens"
    print(f"{'served ' + what:<44} {served:8.2f}")
    print(f"{'in-process ' + what:<44} {local:8.2f}")


# ==============================================================================================
# routing: R3 against no replay on a tiny mixture-of-experts policy


def tiny_moe_policy(root: Path, layers: int, experts: int, init: float) -> tuple[Path, Path]:
    """The demo's task files and a random-init Qwen3-MoE (top-2 of `experts`) on its
    word-level tokenizer, weights drawn with std `init` (wide: confident next-token
    distributions, whose log-probs a changed expert moves), routers drawn wide so tokens
    spread over the experts -> (policy directory, prompts file)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from rlhf_dist.demo import task
    from rlhf_dist.models import routing

    files = task.write_task(root / "data", seed=0, n_sft=8, n_pref=8, n_pref_eval=8,
                            n_prompts=64, n_eval_prompts=8)  # fmt: skip
    tok = task.build_tokenizer(files.tokenizer_dir)
    config = Qwen3MoeConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=experts, num_experts_per_tok=2, max_position_embeddings=128,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id, initializer_range=init,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for r in routing.routers(model):
            r.weight.normal_(0, 1.0)
    path = root / "policy"
    model.save_pretrained(str(path), safe_serialization=True)
    tok.save_pretrained(str(path))
    return path, files.prompts


def routing_tree(out: Path, policy: Path, prompts: Path, url: str, args, mode: str) -> dict:
    return {
        "run": {"output_dir": str(out / mode), "seed": 0, "log_every": 1, "progress": False},
        "model": {"policy": str(policy)},
        "data": {"train": str(prompts), "max_prompt_length": 16, "max_length": 48},
        "generation": {"max_new_tokens": args.new, "temperature": 1.0, "backend": "server",
                       "server_urls": [url], "server_token_env": TOKEN_ENV,
                       # bf16 serving against the fp32 trainer: the post-sync check's gap
                       # is the mismatch measured here, not a failed sync
                       "server_sync_tolerance": 1.0},
        "reward": {"function": "rlhf_dist.demo.task:positive_word_reward"},
        "ppo": {"iterations": args.iterations, "rollout_batch_size": args.prompts,
                "samples_per_prompt": 4, "rollout_micro_batch_size": 64, "ppo_epochs": 2,
                "minibatch_size": args.prompts * 2, "estimator": "grpo", "kl_coef": 0.0,
                "optim": {"lr": 1e-3}, "routing_replay": mode},
        "perf": {"num_threads": args.threads},
    }  # fmt: skip


def routing_main(argv: list[str]) -> None:
    """R3 against no replay: a tiny Qwen3-MoE served in bf16, trained in fp32, GRPO with
    ppo.routing_replay none and r3 on the same server; prints the mean sampler-vs-trainer
    log-prob gap and the routing-flip rate."""
    ap = argparse.ArgumentParser(prog=sys.argv[0], description=routing_main.__doc__)
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--init", type=float, default=0.2, help="std of the random weights")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    os.environ.setdefault(TOKEN_ENV, os.urandom(16).hex())
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        policy, prompts = tiny_moe_policy(root, args.layers, args.experts, args.init)
        port = free_port()
        server = start_server(policy, port, args.threads, root, dtype="bfloat16")
        try:
            url = f"http://127.0.0.1:{port}"
            rows = {m: train(routing_tree(root, policy, prompts, url, args, m), root, args.threads)
                    for m in ("none", "r3")}  # fmt: skip
        finally:
            server.terminate()
            server.wait(timeout=60)
    mean = lambda mode, key: statistics.fmean(r[key] for r in rows[mode])  # noqa: E731
    print(f"tiny Qwen3-MoE ({args.layers} layers, top-2 of {args.experts} experts), served "
          f"bf16, trained fp32; {args.iterations} GRPO iterations x {args.prompts * 4} "
          f"responses of <= {args.new} tokens; means over iterations")  # fmt: skip
    print("| routing_replay | trainer vs sampler mean abs log-prob gap | routing-flip rate |")
    print("| --- | --- | --- |")
    print(f"| none | {mean('none', 'rollout/sampler_logprob_absdiff'):.4f} | not recorded |")
    print(f"| r3, the same rollouts scored without replay | "
          f"{mean('r3', 'router/logprob_gap_unreplayed'):.4f} | "
          f"{mean('r3', 'router/flip_rate'):.4f} |")  # fmt: skip
    print(f"| r3 (replayed) | {mean('r3', 'router/logprob_gap_replayed'):.4f} | 0 (forced) |")


# tail: trained tokens per second when response lengths are heavy-tailed
# k-step staleness (ppo.max_staleness; docs/serving.md, "Asynchronous rollouts") where it
# matters most: a synchronous step waits for its longest rollout, one step off hides only the
# shorter of generation and training, a deeper queue also evens out the long rollouts.
#
# The task: a tiny Llama ("small": 128 hidden, 4 layers; the demo's word tokenizer) made a
# two-state Markov chain over its words (`tail_policy`): attention and MLP outputs zeroed, so
# the next-token distribution depends on the current token alone. A "short" word ends the
# response with probability 1/16 per token (median 11 tokens), a "long" word with 1/128
# (median 89): 10% of the prompts end on a long word, so about 10% of the responses are ~8x
# the median, capped at --new tokens. GRPO at temperature 1, the demo's positive-word
# reward, lr 1e-6 (the weights move, the length distribution stays the task's), no
# checkpoints (a scheduled one drains the queue), one trainer and one `rlhf-dist serve`
# process, --threads each, a fresh server per mode.
#
# Per mode: trained tokens per second = sum of the trained response tokens (rollout/length x
# rollout/sequences) / sum of time/total over the iterations after the first (start-up);
# the mean staleness and the trained and sampled response lengths (async/*_len_mean weighed
# by their rows over the run). Modes: sync (max_staleness 0), k=1, k=4 (ppo.decoupled with
# tis for k >= 1), k=4 partial (ppo.partial_rollouts: the syncs land while the server
# generates; its staleness column is the trained tokens' mean, in versions, and the share
# of rows whose version switched mid-response is printed under the table). The last line's
# speed-ups are k=4 partial's. Before it, the lengths table: every trained row's response
# length (samples.jsonl with run.samples_every 1, all rows) over the whole run, its mean,
# p50, p90 and max, the sampled side (rows and mean length the servers returned, dropped
# rollouts included) and the two-sample KS statistic of each mode's trained lengths
# against the sync run's with its asymptotic p-value (`ks_two_sample`): all modes draw the
# same prompts in the same order, so the sync run's rows are the on-policy sample of the
# task's lengths.
#
# Usage: bash launch/bench/async_tail.sh [tail] [--iterations 16] [--threads 1] [--new 256]
#        [--prompts 8] [--out runs/bench/async_tail]

TAIL_SHORT_EOS = 1 / 16  # P(end) after a short word: median response 11 tokens
TAIL_LONG_EOS = TAIL_SHORT_EOS / 8  # after a long word: median 89 tokens
TAIL_LONG_SHARE = 0.1  # prompts that end on a long word


def tail_policy(root: Path) -> tuple[Path, list[int]]:
    """The Markov-chain policy of the tail task saved under root/policy -> (its path, the
    ids of the long words). Token state: e_0 (short words, specials) or e_1 (long words)
    in the embedding; the final RMSNorm makes it sqrt(H) e_j, so lm_head's column j holds
    each next token's logit / sqrt(H) from state j."""
    from transformers import LlamaForCausalLM

    tokenizer = task.build_tokenizer(root / "tokenizer")
    config = task.tiny_llama_config(len(tokenizer), tokenizer.pad_token_id,
                                    tokenizer.bos_token_id, tokenizer.eos_token_id, "small")  # fmt: skip
    config.max_position_embeddings = 512  # prompts of 3 words, responses up to --new tokens
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    words = list(range(len(task.SPECIAL_TOKENS), len(tokenizer)))
    long_words = words[::4]
    short_words = [w for w in words if w not in set(long_words)]
    scale = config.hidden_size**0.5
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        embed.zero_()
        embed[:, 0] = 1.0
        embed[long_words, 0], embed[long_words, 1] = 0.0, 1.0
        head.zero_()
        head[:, :2] = -30.0 / scale
        eos = tokenizer.eos_token_id
        head[eos, 0], head[eos, 1] = math.log(TAIL_SHORT_EOS), math.log(TAIL_LONG_EOS)
        head[short_words, 0] = math.log((1 - TAIL_SHORT_EOS) / len(short_words))
        head[long_words, 1] = math.log((1 - TAIL_LONG_EOS) / len(long_words))
        head[eos, :2] /= scale
        head[short_words, 0] /= scale
        head[long_words, 1] /= scale
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = eos
    model.save_pretrained(str(root / "policy"), safe_serialization=True)
    tokenizer.save_pretrained(str(root / "policy"))
    return root / "policy", long_words


def tail_prompts(path: Path, tokenizer_dir: Path, long_words: list[int], n: int = 256) -> None:
    """n prompts of three random words; TAIL_LONG_SHARE of them end on a long word."""
    import random

    from transformers import AutoTokenizer

    vocab = AutoTokenizer.from_pretrained(str(tokenizer_dir)).convert_ids_to_tokens
    rng, long_set = random.Random(0), set(long_words)
    words = list(range(len(task.SPECIAL_TOKENS), len(task.all_words()) + len(task.SPECIAL_TOKENS)))
    short = [w for w in words if w not in long_set]
    with path.open("w", encoding="utf-8") as f:
        for _ in range(n):
            last = rng.choice(long_words if rng.random() < TAIL_LONG_SHARE else short)
            ids = [rng.choice(short), rng.choice(short), last]
            f.write(json.dumps({"prompt": " ".join(vocab(ids))}) + "\n")


def tail_tree(
    out: Path, policy: Path, prompts: Path, url: str, args, k: int, partial: bool = False
) -> dict:
    p = args.prompts
    return {
        "run": {"output_dir": str(out / f"k{k}{'partial' if partial else ''}"), "seed": args.seed, "log_every": 1, "progress": False,
                "checkpoint_every": 0, "histogram_every": 0, "samples_every": 1,
                "num_samples": 4 * p},  # every trained row's length (tail_lengths)
        "model": {"policy": str(policy)},
        "data": {"train": str(prompts), "max_prompt_length": 8, "max_length": 8 + args.new},
        "generation": {"backend": "server", "server_urls": [url], "server_token_env": TOKEN_ENV,
                       "max_new_tokens": args.new, "temperature": 1.0},
        "reward": {"function": "rlhf_dist.demo.task:positive_word_reward"},
        "ppo": {"estimator": "grpo", "iterations": args.iterations, "rollout_batch_size": p,
                "samples_per_prompt": 4, "rollout_micro_batch_size": 4 * p, "ppo_epochs": 1,
                "minibatch_size": 4 * p, "micro_batch_size": 4 * p, "optim": {"lr": 1e-6},
                "kl_coef": 0.0, "max_staleness": k, "partial_rollouts": partial} | (
                    {"decoupled": True, "rollout_correction": "tis"} if k else {}),
        "perf": {"num_threads": args.threads},
        "distributed": {"timeout_s": 300},
    }  # fmt: skip


def tail_figures(rows: list[dict]) -> dict[str, float]:
    """Trained tokens/s, s/iteration, mean staleness and the run's trained and sampled
    response lengths over rows[1:] (the first: start-up)."""
    steady = rows[1:] or rows
    tokens = sum(r["rollout/length"] * r["rollout/sequences"] for r in steady)
    seconds = sum(r["time/total"] for r in steady)

    def weighed(kind: str) -> float:
        rows_of = [r.get(f"async/{kind}_rows", r["rollout/sequences"]) for r in steady]
        lengths = [r.get(f"async/{kind}_len_mean", r["rollout/length"]) for r in steady]
        return sum(a * b for a, b in zip(rows_of, lengths)) / max(sum(rows_of), 1.0)

    # partial rollouts: the trained tokens' staleness, in versions (k=4 alone: iterations)
    stale = "rollout/token_staleness_mean"
    if stale not in steady[0]:
        stale = "rollout/staleness_mean"
    return {"tok/s": tokens / seconds, "s/it": seconds / len(steady),
            "staleness": statistics.mean(r.get(stale, 0.0) for r in steady),
            "switched": statistics.mean(r.get("rollout/version_switched_rows", 0.0) for r in steady),
            "trained": weighed("trained"), "sampled": weighed("sampled")}  # fmt: skip


def tail_lengths(run_dir: Path) -> tuple[list[int], dict[str, float]]:
    """Every trained row's response length over the run (samples.jsonl, all rows of every
    iteration) and the run's sampled side: rows and mean length of what came back from the
    servers (async/sampled_*, dropped rollouts included) and the rollouts dropped."""
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    trained = [int(s["length"]) for s in samples]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time/total" in r]
    n = sum(r.get("async/sampled_rows", r["rollout/sequences"]) for r in rows)
    tokens = sum(r.get("async/sampled_rows", r["rollout/sequences"])
                 * r.get("async/sampled_len_mean", r["rollout/length"]) for r in rows)  # fmt: skip
    dropped = sum(r.get("rollout/stale_dropped", 0.0) for r in rows)
    last = [s["prompt"].split()[-1] for s in samples]  # the word that sets the row's law
    return trained, {"rows": n, "mean": tokens / max(n, 1.0), "dropped": dropped, "last": last}


def tail_law(lengths: list[int], long_rows: list[bool], cap: int) -> tuple[float, float, float]:
    """The task's exact length law for these rows against their lengths -> (its mean, the
    one-sample KS statistic D, its asymptotic p-value). A response whose prompt ends on a
    long word ends after each token with probability q = TAIL_LONG_EOS, else
    TAIL_SHORT_EOS, so P(L <= x) = 1 - (1 - q)^x below the cap and 1 at it; the law of the
    rows is the mean of theirs (lr 1e-6 leaves the starting policy's law in place)."""
    n = len(lengths)
    law = [sum(1 - (1 - (TAIL_LONG_EOS if r else TAIL_SHORT_EOS)) ** x if x < cap else 1.0
               for r in long_rows) / n for x in range(1, cap + 1)]  # fmt: skip
    empirical = [sum(v <= x for v in lengths) / n for x in range(1, cap + 1)]
    d = max(abs(a - b) for a, b in zip(law, empirical))
    return 1 + sum(1 - f for f in law[:-1]), d, ks_pvalue(n, d)


def ks_pvalue(n: float, d: float) -> float:
    """Q_KS(lambda) = 2 sum_j (-1)^(j-1) exp(-2 j^2 lambda^2), lambda = (sqrt(n) + 0.12 +
    0.11 / sqrt(n)) d: the asymptotic p-value of a KS statistic d over n (effective) rows
    (Numerical Recipes, 3rd ed., eq. 14.3.18-14.3.19; conservative with ties)."""
    lam = (math.sqrt(n) + 0.12 + 0.11 / math.sqrt(n)) * d
    if lam < 1e-3:
        return 1.0
    q = 2 * sum((-1) ** (j - 1) * math.exp(-2 * j * j * lam * lam) for j in range(1, 101))
    return min(max(q, 0.0), 1.0)


def ks_two_sample(a: list[int], b: list[int]) -> tuple[float, float]:
    """The two-sample Kolmogorov-Smirnov statistic D = max_x |F_a(x) - F_b(x)| (empirical
    CDFs, right-continuous, so ties count on both sides at once) and its asymptotic p-value
    over N = n m / (n + m) rows (ks_pvalue)."""
    import bisect

    xs, ys = sorted(a), sorted(b)
    cdf = lambda v, x: bisect.bisect_right(v, x) / len(v)  # noqa: E731
    d = max(abs(cdf(xs, x) - cdf(ys, x)) for x in set(xs) | set(ys))
    return d, ks_pvalue(len(xs) * len(ys) / (len(xs) + len(ys)), d)


def print_lengths(results: dict[str, dict], long_words: set[str], cap: int) -> None:
    """Each mode's trained lengths (mean, p50, p90, max), its sampled side, the KS test of
    its trained lengths against the sync run's (the on-policy sample of the task) and
    against the task's exact law for its rows (tail_law)."""
    print("response lengths over every iteration, tokens per row (trained: samples.jsonl; "
          "sampled: what the servers returned, async/sampled_*)")  # fmt: skip
    print(f"{'mode':<14} {'trained rows':>12} {'mean':>6} {'p50':>5} {'p90':>5} {'max':>4} "
          f"{'sampled rows':>12} {'mean':>6} {'dropped':>7} {'KS D vs sync':>12} {'p':>6} "
          f"{'law mean':>8} {'KS D vs law':>11} {'p':>6}")  # fmt: skip
    reference = results["sync"]["lengths"]
    for name, f in results.items():
        v, side = f["lengths"], f["sampled_side"]
        deciles = statistics.quantiles(v, n=10, method="inclusive")
        d, p = ks_two_sample(v, reference)
        mean, d_law, p_law = tail_law(v, [w in long_words for w in side["last"]], cap)
        print(f"{name:<14} {len(v):12d} {statistics.mean(v):6.2f} {statistics.median(v):5.0f} "
              f"{deciles[8]:5.0f} {max(v):4d} {side['rows']:12.0f} {side['mean']:6.2f} "
              f"{side['dropped']:7.0f} {d:12.3f} {p:6.3f} {mean:8.2f} {d_law:11.3f} "
              f"{p_law:6.3f}")  # fmt: skip


def tail_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description="k-step staleness on heavy-tailed lengths")
    parser.add_argument("--iterations", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--new", type=int, default=256, help="max new tokens per response")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per rollout (x4 samples)")
    parser.add_argument("--out", default="runs/bench/async_tail")
    parser.add_argument("--seed", type=int, default=0, help="run.seed (the requests' seeds)")
    parser.add_argument("--modes", nargs="+", default=[m[0] for m in TAIL_MODES],
                        choices=[m[0] for m in TAIL_MODES],
                        help="a subset, for the lengths table alone (against sync); the last "
                        "line needs sync, k=1 and k=4 partial")  # fmt: skip
    args = parser.parse_args(argv)
    os.environ.setdefault(TOKEN_ENV, os.urandom(16).hex())
    out = Path(args.out).resolve()
    policy, long_words = tail_policy(out / "task")
    prompts = out / "task" / "prompts.jsonl"
    tail_prompts(prompts, policy, long_words)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, k, partial in (m for m in TAIL_MODES if m[0] in args.modes):
            port = free_port()
            server = start_server(policy, port, args.threads, Path(tmp))
            try:
                url = f"http://127.0.0.1:{port}"
                tree = tail_tree(out, policy, prompts, url, args, k, partial)
                results[name] = tail_figures(train(tree, Path(tmp), args.threads))
                trained, sampled = tail_lengths(Path(tree["run"]["output_dir"]))
                results[name] |= {"lengths": trained, "sampled_side": sampled}
            finally:
                server.terminate()
                server.wait(timeout=60)
    from transformers import AutoTokenizer

    names = AutoTokenizer.from_pretrained(str(policy)).convert_ids_to_tokens(long_words)
    print_tail(args, results, set(names))


TAIL_MODES = (("sync", 0, False), ("k=1", 1, False), ("k=4", 4, False), ("k=4 partial", 4, True))


def print_tail(args, results: dict[str, dict], long_words: set[str]) -> None:
    print(f"heavy-tailed GRPO ({device()}): {args.prompts} x 4 responses of up to {args.new} "
          f"tokens, ~{TAIL_LONG_SHARE:.0%} of them ~8x the median; one trainer + one server, "
          f"{args.threads} thread(s) each; {args.iterations} iterations, first dropped")  # fmt: skip
    print(f"{'mode':<14} {'trained tok/s':>13} {'s/iteration':>11} {'staleness':>9} "
          f"{'trained len':>11} {'sampled len':>11}")  # fmt: skip
    for name, f in results.items():
        print(f"{name:<14} {f['tok/s']:13.1f} {f['s/it']:11.2f} {f['staleness']:9.2f} "
              f"{f['trained']:11.2f} {f['sampled']:11.2f}")  # fmt: skip
    if "k=4 partial" in results:
        print(f"(k=4 partial: staleness in versions per trained token; "
              f"{results['k=4 partial']['switched']:.1%} of its rows switched version "
              "mid-response)")  # fmt: skip
    if "sync" in results:
        print_lengths(results, long_words, args.new)
    if not {"sync", "k=1", "k=4 partial"} <= set(results):
        return
    best = results["k=4 partial"]["tok/s"]
    print(f"async_tail: speedup_vs_sync={best / results['sync']['tok/s']:.2f} "
          f"speedup_vs_k1={best / results['k=1']['tok/s']:.2f}")  # fmt: skip


# ==============================================================================================
# http: Request overhead of the trainer's rollout-server client (generation/server.py
# `ServerEngine.call`) against the serve tests' tiny server (the demo's tiny random policy,
# one thread): milliseconds per call of GET /health (no model work) and of POST /score of
# two 16-token sequences (one tiny forward), one caller after another and k callers at once
# (k = 1 and 4: the requests in flight under ppo.max_staleness), through the client's
# transport (rlhf_dist/http_client.py, httpx with pooled connections) and through the
# standard library's urllib as the client called it before (a new connection per call), alternating
# rounds of the two so that both see the same machine load. The figures are in
# docs/serving.md ("HTTP client").
#
# Usage: python launch/bench/async_bench.py http [--calls 200] [--out runs/bench/http]


def urllib_call(url: str, body: dict | None, token: str, timeout_s: float) -> dict:
    """One call as the client made it on urllib: a new connection each time."""
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}
    request = urllib.request.Request(url, data, headers)
    with urllib.request.urlopen(request, timeout=timeout_s) as answer:
        return dict(json.loads(answer.read()))


def http_timed(call: Callable[[], object], calls: int, at_once: int) -> float:
    """Median milliseconds per call over `calls` calls, `at_once` callers in flight
    (the wall time of each round of `at_once` concurrent calls, divided by `at_once`)."""
    from concurrent.futures import ThreadPoolExecutor

    rounds = []
    with ThreadPoolExecutor(at_once) as pool:
        for _ in range(max(1, calls // at_once)):
            start = time.perf_counter()
            list(pool.map(lambda _: call(), range(at_once)))
            rounds.append((time.perf_counter() - start) * 1000 / at_once)
    return statistics.median(rounds)


def http_main(argv: list[str]) -> None:
    """Milliseconds per call of the servers' client, httpx against urllib (below)."""
    import argparse

    from rlhf_dist.generation.server import ServerEngine

    parser = argparse.ArgumentParser(description="http: request overhead of the servers' client")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    os.environ.setdefault(TOKEN_ENV, "bench-token")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.out or tmp)
        work.mkdir(parents=True, exist_ok=True)
        tokenizer = task.build_tokenizer(work / "tokenizer")
        policy = task.build_tiny_models(work / "models", tokenizer, size="tiny")["policy"]
        port = free_port()
        proc = start_server(policy, port, threads=1, workdir=work)
        try:
            url = f"http://127.0.0.1:{port}"
            cfg = config_from_dict(
                {"generation": {"backend": "server", "server_urls": [url],
                                "server_token_env": TOKEN_ENV}}
            )  # fmt: skip
            engine = ServerEngine(cfg, is_main=True, all_max=lambda x: x)
            seqs = {"sequences": [[4, 5, 6, 7] * 4] * 2, "temperature": 1.0}
            token = os.environ[TOKEN_ENV]
            for path, body in [("/health", None), ("/score", seqs)]:
                name = f"{'GET' if body is None else 'POST'} {path}"
                calls = {
                    "httpx": lambda p=path, b=body: engine.call(url, p, b),
                    "urllib": lambda p=path, b=body: urllib_call(url + p, b, token, 60.0),
                }
                for call in calls.values():  # warm-up: first connections, the first forward
                    for _ in range(10):
                        call()
                for k in (1, 4):
                    ms: dict[str, list[float]] = {t: [] for t in calls}
                    for _ in range(5):  # alternating rounds
                        for t, call in calls.items():
                            ms[t].append(http_timed(call, args.calls // 5, k))
                    figures = " ".join(f"{t}_ms={statistics.median(v):.3f}" for t, v in ms.items())
                    print(f"http_overhead: {name} k={k} {figures}", flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=30)


# ==============================================================================================
# parity: does k = 4 with partial rollouts learn as the synchronous run does?
# Learning parity of ppo.max_staleness = 4 with ppo.partial_rollouts (docs/serving.md,
# "Learning parity"): two GRPO tasks, each trained twice per seed from the same starting
# policy against a fresh `rlhf-dist serve` process (one thread each):
# - sync: max_staleness 0, every rollout sampled by the weights it trains;
# - k=4 partial: max_staleness 4, partial rollouts (updates land mid-response), the
#   decoupled objective with tis (as the tail mode's k >= 1 modes).
# Both modes set run.checkpoint_every 0 (a scheduled checkpoint drains the queue) and are
# otherwise the task's own settings:
# - demo: the text demo's GRPO stage (demo/pipeline.py stage_configs, --algorithm grpo: 16
#   prompts x 4 samples, 60 iterations, the demo's reward model, KL 0.05 in the reward)
#   from the seed's SFT policy and reward model, trained once per seed; held-out gold in
#   [0, 1] and KL to the SFT policy (nats per response, sampled at the demo's 0.7), as the
#   demo evaluates them;
# - arithmetic: the arithmetic demo's GRPO stage (demo/arithmetic_demo.py, the real
#   SmolLM2-135M, 8 prompts x 8 samples, 20 iterations unless --iterations cuts them for
#   both modes alike); held-out accuracy under greedy decoding (the demo's 95 prompts) and
#   KL to the base model (nats per response, sampled at temperature 1 on the first
#   --kl-prompts held-out prompts: the greedy pass gives no KL).
# Per run: the figures, the training wall seconds and, for k=4 partial, the trained tokens'
# mean staleness in versions and the share of rows that switched version mid-response.
# Each row is printed and appended to OUT/results.jsonl when its run ends; the summary
# gives, for each pair of PAIRS trained on the same seeds (sync vs k=4 partial; k=4 partial
# with checkpoints vs the same killed and resumed), each mode's mean and seed-to-seed standard deviation and
# the difference of the means, paired by seed, with its standard error.
#
# `--modes` trains other modes instead (PARITY_MODES: k = 1, 2, 4 with the same correction,
# k = 4 with no correction or uncapped weights, the KL-vs-k sweep of docs/serving.md; "k=4
# partial, checkpointed" and "k=4 partial, killed": checkpoints every N // 4 iterations, the
# latter's trainer SIGKILLed some iterations after one and resumed with run.resume=auto
# against the same server, `kill_plan`), and `--kl-coef C` and
# `--ppo-epochs N` set the text demo's ppo.kl_coef and ppo.ppo_epochs for every mode of
# the call (" kl=C", " epochs=N" added to the mode's name; such modes pair with nothing).
#
# Usage: bash launch/bench/async_tail.sh parity [--tasks demo arithmetic] [--seeds 0 1 2]
#        [--iterations 20] [--demo-iterations N] [--kl-prompts 32] [--parallel] [--quick]
#        [--modes sync "k=4 partial"] [--kl-coef C] [--ppo-epochs N] [--out runs/bench/async_parity]
# (--parallel: two modes train at once, each against its own server, so they share the
# machine's load; the SFT policy, reward model and SFT evaluation already under OUT are kept.)
# (--quick: the demos' smoke sizes, a check that the bench runs, not a measurement)

OFF_POLICY = {"decoupled": True, "rollout_correction": "tis"}
PARITY_MODES = {
    "sync": {"max_staleness": 0},
    "k=4 partial": {"max_staleness": 4, "partial_rollouts": True} | OFF_POLICY,
    # --modes: the KL-vs-k sweep (docs/serving.md, "Why k = 4 ends further from SFT")
    "k=1": {"max_staleness": 1} | OFF_POLICY,
    "k=2": {"max_staleness": 2} | OFF_POLICY,
    "k=4": {"max_staleness": 4} | OFF_POLICY,
    "k=4, no correction": {"max_staleness": 4, "decoupled": False, "rollout_correction": "none"},
    "k=4 partial, no correction": {"max_staleness": 4, "partial_rollouts": True,
                                   "decoupled": False, "rollout_correction": "none"},
    "k=4, raw weights": {"max_staleness": 4, "decoupled": True, "rollout_correction": "none"},
    # k=4 partial with checkpoints, and the same with its trainer SIGKILLed mid-run and
    # resumed, the server kept (`kill_plan`; the queue refills after each checkpoint)
    "k=4 partial, checkpointed": {"max_staleness": 4, "partial_rollouts": True} | OFF_POLICY,
    "k=4 partial, killed": {"max_staleness": 4, "partial_rollouts": True} | OFF_POLICY,
}  # fmt: skip
CHECKPOINTED, KILLED = "k=4 partial, checkpointed", "k=4 partial, killed"
PAIRS = (("sync", "k=4 partial"), (CHECKPOINTED, KILLED))  # the summary's comparisons


def parity_served(tree: dict, out: Path, mode: str, url: str) -> dict:
    """A task's GRPO tree trained in `mode` against the server at `url`, writing to out."""
    tree = copy.deepcopy(tree)
    every = kill_plan(tree)[0] if mode in (CHECKPOINTED, KILLED) else 0
    tree["run"] |= {"output_dir": str(out), "progress": False, "checkpoint_every": every}
    tree["generation"] |= {"backend": "server", "server_urls": [url],
                           "server_token_env": TOKEN_ENV}  # fmt: skip
    tree["ppo"] |= PARITY_MODES[mode]
    tree["perf"] = {"num_threads": 1}
    return tree


def kill_plan(tree: dict) -> tuple[int, int]:
    """(run.checkpoint_every, the iteration after which the trainer is SIGKILLed) of the
    killed mode over ppo.iterations N: checkpoints every N // 4, killed half an interval
    after the one at N // 2, so those iterations are lost and trained again (60: 15, 37)."""
    every = max(1, tree["ppo"]["iterations"] // 4)
    return every, 2 * every + max(1, every // 2)


def parity_train(tree: dict, policy: Path, workdir: Path, mode: str) -> dict[str, float]:
    """Train `tree` in `mode` against a fresh server of `policy` -> wall seconds, staleness."""
    port = free_port()
    server = start_server(policy, port, 1, workdir)
    try:
        out = Path(tree["run"]["output_dir"])
        start = time.perf_counter()
        served = parity_served(tree, out, mode, f"http://127.0.0.1:{port}")
        kill = kill_plan(tree)[1] if mode == KILLED else 0
        rows = train(served, workdir, 1, kill_after=kill)
        seconds = time.perf_counter() - start
    finally:
        server.terminate()
        server.wait(timeout=60)
    stale = [r.get("rollout/token_staleness_mean", r.get("rollout/staleness_mean", 0.0))
             for r in rows]  # fmt: skip
    switched = [r.get("rollout/version_switched_rows", 0.0) for r in rows]
    return {"seconds": seconds, "staleness": statistics.mean(stale),
            "switched": statistics.mean(switched)}  # fmt: skip


def parity_record(out: Path, row: dict) -> None:
    """Print one run's row and append it to out/results.jsonl (kept if the bench is cut)."""
    with (out / "results.jsonl").open("a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
    print(f"{row['task']:<10} {row['mode']:<12} {row['seed']:>4} {row['score']:9.3f} "
          f"{row['kl']:7.2f} {row['seconds']:8.0f} {row['staleness']:9.2f} "
          f"{row['switched']:8.1%}", flush=True)  # fmt: skip


def parity_demo_seed(out: Path, seed: int, args, runtime) -> None:
    """The text demo: SFT and RM once, then GRPO sync and k=4 partial, each evaluated."""
    from rlhf_dist.evaluate import run_eval
    from rlhf_dist.trainers.reward import train_reward_model
    from rlhf_dist.trainers.sft import train_sft

    root = out / "demo" / f"seed{seed}"
    files, models = pipeline.task_and_models(root, seed)  # deterministic per seed
    trees = pipeline.stage_configs(root, files, models, seed, args.quick, algorithm="grpo")
    for tree in trees.values():  # one thread: this process shares the cores with the runs
        tree["perf"] = {"num_threads": 1}
    if not (root / "rm" / "final").exists():  # a rerun into the same OUT keeps them
        train_sft(config_from_dict(trees["sft"]), runtime)
        train_reward_model(config_from_dict(trees["rm"]), runtime)
    evaluate = config_from_dict(trees["eval"])
    done = root / "eval_sft" / "summary.json"  # kept by a rerun, as the models are
    sft = (json.loads(done.read_text()) if done.exists()
           else run_eval(pipeline._with_output(evaluate, root / "eval_sft"), runtime))  # fmt: skip
    parity_record(out, {"task": "demo", "mode": "SFT", "seed": seed, "score": sft["gold_reward"],
                        "kl": 0.0, "seconds": 0.0, "staleness": 0.0, "switched": 0.0})  # fmt: skip
    if args.demo_iterations:
        trees["grpo"]["ppo"]["iterations"] = args.demo_iterations
    if args.kl_coef is not None:
        trees["grpo"]["ppo"]["kl_coef"] = args.kl_coef
    if args.ppo_epochs:
        trees["grpo"]["ppo"]["ppo_epochs"] = args.ppo_epochs
    trained = parity_modes(trees["grpo"], root, root / "sft" / "final", args)
    for mode, figures in trained.items():
        name = parity_name(mode)
        final = str(root / name / "final")
        ev = run_eval(pipeline._with_output(evaluate, root / f"eval_{name}", final), runtime)
        parity_record(out, {"task": "demo", "mode": mode, "seed": seed, "score": ev["gold_reward"],
                            "kl": ev["kl_to_ref"]} | figures)  # fmt: skip


def parity_name(mode: str) -> str:
    return mode.replace("=", "").replace(",", "").replace(" ", "_")


def parity_modes(grpo: dict, root: Path, policy: Path, args) -> dict[str, dict]:
    """Train the GRPO tree in every mode of --modes (root/<mode>, " kl=C" appended with
    --kl-coef C), one after the other or, --parallel, two at once (each its own server)
    -> each mode's figures (parity_train)."""
    from concurrent.futures import ThreadPoolExecutor

    suffix = "" if args.kl_coef is None else f" kl={args.kl_coef:g}"
    suffix += f" epochs={args.ppo_epochs}" if args.ppo_epochs else ""

    def one(mode: str) -> dict:
        tree = copy.deepcopy(grpo)
        tree["run"]["output_dir"] = str(root / parity_name(mode + suffix))
        with tempfile.TemporaryDirectory() as tmp:
            return parity_train(tree, policy, Path(tmp), mode)

    with ThreadPoolExecutor(2 if args.parallel else 1) as pool:
        return {m + suffix: f for m, f in zip(args.modes, pool.map(one, args.modes))}


def parity_arithmetic_trees(root: Path, policy: Path, seed: int, args) -> dict:
    """The arithmetic demo's trees, GRPO cut to --iterations, and `kl`: the sampled pass."""
    trees = arithmetic_demo.arithmetic_stage_configs(root, policy, seed, args.quick)
    for tree in trees.values():  # one thread: this process shares the cores with the runs
        tree["perf"] = {"num_threads": 1}
    trees["grpo"]["ppo"]["iterations"] = args.iterations
    kl = copy.deepcopy(trees["eval"])
    kl["generation"].pop("top_k")  # sampled at the training temperature, 1
    kl["eval"] |= {"num_prompts": args.kl_prompts, "reference": str(policy)}
    return trees | {"kl": kl}


def parity_arithmetic_seed(out: Path, seed: int, args, runtime) -> None:
    """The arithmetic task: GRPO sync and k=4 partial from the base model, each evaluated."""
    from rlhf_dist.evaluate import run_eval

    policy, root = smollm2.build("shipped"), out / "arithmetic" / f"seed{seed}"
    trees = parity_arithmetic_trees(root, policy, seed, args)
    greedy, sampled = config_from_dict(trees["eval"]), config_from_dict(trees["kl"])
    for mode, figures in parity_modes(trees["grpo"], root, policy, args).items():
        name = parity_name(mode)
        final = str(root / name / "final")
        ev = run_eval(pipeline._with_output(greedy, root / f"eval_{name}", final), runtime)
        kl = run_eval(pipeline._with_output(sampled, root / f"kl_{name}", final), runtime)
        parity_record(out, {"task": "arithmetic", "mode": mode, "seed": seed,
                            "score": ev["score"], "kl": kl["kl_to_ref"]} | figures)  # fmt: skip
    if seed == args.seeds[0]:  # greedy: the base model's accuracy is the same for every seed
        base = run_eval(pipeline._with_output(greedy, out / "arithmetic" / "eval_base"), runtime)
        parity_record(out, {"task": "arithmetic", "mode": "base", "seed": seed,
                            "score": base["score"], "kl": 0.0, "seconds": 0.0,
                            "staleness": 0.0, "switched": 0.0})  # fmt: skip


def parity_summary(rows: list[dict]) -> None:
    """Per task and pair of PAIRS (A, B) trained on the same seeds: each mode's mean and
    seed-to-seed sd, and B - A paired by seed with its standard error."""
    print("task       figure  A mean (sd)      B mean (sd)     B - A (paired se)  seeds  A -> B")
    sd = lambda v: statistics.stdev(v) if len(v) > 1 else float("nan")  # noqa: E731
    for task_name in dict.fromkeys(r["task"] for r in rows):
        mine = [r for r in rows if r["task"] == task_name]
        for first, second in PAIRS:
            by = {m: {r["seed"]: r for r in mine if r["mode"] == m} for m in (first, second)}
            seeds = sorted(set(by[first]) & set(by[second]))
            for figure in ("score", "kl") if seeds else ():
                a = [by[first][s][figure] for s in seeds]
                b = [by[second][s][figure] for s in seeds]
                d = [y - x for x, y in zip(a, b)]
                print(f"{task_name:<10} {figure:<7} {statistics.mean(a):6.3f} ({sd(a):5.3f})   "
                      f"{statistics.mean(b):6.3f} ({sd(b):5.3f})   {statistics.mean(d):+6.3f} "
                      f"({sd(d) / math.sqrt(len(d)):5.3f})   {len(seeds):>5}  {first} -> {second}")  # fmt: skip


def parity_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description="learning parity: sync vs k=4 partial rollouts")
    parser.add_argument("--tasks", nargs="+", default=["demo", "arithmetic"],
                        choices=("demo", "arithmetic"))  # fmt: skip
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--iterations", type=int, default=arithmetic_demo.ITERATIONS,
                        help="arithmetic GRPO iterations, both modes")  # fmt: skip
    parser.add_argument("--demo-iterations", type=int, default=0,
                        help="cut the text demo's GRPO iterations (its own: 60), both modes")  # fmt: skip
    parser.add_argument("--parallel", action="store_true",
                        help="train both modes at once (each its own server)")  # fmt: skip
    parser.add_argument("--kl-prompts", type=int, default=32)
    parser.add_argument("--modes", nargs="+", default=list(PAIRS[0]), choices=list(PARITY_MODES),
                        help="the modes each seed trains (the summary pairs those of PAIRS)")  # fmt: skip
    parser.add_argument("--kl-coef", type=float, default=None,
                        help="ppo.kl_coef of the text demo's runs (its own: 0.05)")  # fmt: skip
    parser.add_argument("--ppo-epochs", type=int, default=0,
                        help="ppo.ppo_epochs of the text demo's runs (its own: 4)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="the demos' smoke sizes")
    parser.add_argument("--out", default="runs/bench/async_parity")
    args = parser.parse_args(argv)
    from rlhf_dist.distributed import Runtime

    quiet_transformers()
    torch.set_num_threads(1)
    os.environ.setdefault(TOKEN_ENV, os.urandom(16).hex())
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    print("task       mode         seed gold/acc      KL  seconds staleness switched")
    for seed in args.seeds:
        runtime = Runtime(seed=seed, num_threads=1)  # the default, all cores, spin-waits
        for task_name in args.tasks:
            if task_name == "demo":
                parity_demo_seed(out, seed, args, runtime)
            else:
                parity_arithmetic_seed(out, seed, args, runtime)
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    parity_summary(rows)


MODES_ = {"overlap": overlap_main, "demo": demo_main, "serve": serve_main, "tail": tail_main,
          "routing": routing_main, "http": http_main, "parity": parity_main}  # fmt: skip


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in MODES_:
        raise SystemExit(f"usage: async_bench.py MODE [ARGS...] (MODE: {', '.join(MODES_)})")
    sys.argv[0] = " ".join(sys.argv[:2])  # each step's --help names it
    MODES_[sys.argv[1]](sys.argv[2:])
    if sys.argv[1] == "demo":
        sys.exit(end_process())  # a rank leaves without interpreter teardown (api.end_process)


if __name__ == "__main__":
    main()
