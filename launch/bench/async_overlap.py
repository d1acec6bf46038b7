"""Bounded-staleness rollouts (ppo.max_staleness; docs/serving.md, "Asynchronous rollouts"):
seconds per iteration of the same GRPO work with on-policy rollouts from a rollout server
(max_staleness=0) and one step off-policy (1), and how much of generation and training
overlap.

The work: the arithmetic demo's GRPO stage in its quick size (the real SmolLM2-135M, a
reasoning-gym task, PROMPTS x SAMPLES responses of up to NEW tokens, one optimizer step
per rollout), ITERATIONS iterations, with one `rlhf-dist serve` process of the same model
and one trainer process, THREADS threads each. Both runs start from the same weights and
seed against a freshly started server.

Per iteration (the first dropped: start-up), medians from each run's metrics.jsonl:
- t_generate = the sync run's time/generate - time/weight_sync (the servers' rollout,
  waited for);
- t_train = the sync run's time/score + time/update + time/weight_sync (the trainer's
  own work; a weight sync cannot overlap a request);
- t_iteration = the async run's time/total;
- overlap = (t_generate + t_train - t_iteration) / min(t_generate, t_train): 1 when the
  shorter one is fully hidden behind the longer, 0 when the async run is no faster than
  the sync one, negative when it is slower (the two compete for the same cores).
The components come from the sync run because they are the work's own durations: in the
async run generation and training run at once and slow each other where they share cores.
The async run's own time/generate (what the trainer still waited) and
time/generate_request (the servers' seconds, in the background) are printed beside them.

Both processes share the machine's cores: on a 2-core box keep THREADS at 1.

`--environment` plays the same prompts as two-turn episodes of an environment that drives
the policy through the server's chat endpoint (`chat_episode` below;
generation.environment_endpoint): the answer, then "check it", the last number of the
second answer scored. One step off, the next iteration's episodes play on the trainer's
threads while it trains.

`--suite OUT` runs the scale suite's PPO work instead (launch/bench/suite.py `plain` over
the models scale_prepare.py built in OUT, a critic and a reward model; the GPU case of
launch/bench/gpu_suite.sh, `async`): on one GPU the server and the trainer share it, so
the overlap measures how much of generation hides behind training on the same device.

Usage: python launch/bench/async_overlap.py [--iterations 6] [--threads 1] [--new 24]
       [--out runs/bench/async] [--environment [--window MS] | --suite OUT]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import start_server  # noqa: E402 (this folder's rollout-server benchmark)
from suite import SETTINGS, run_config  # noqa: E402 (the scale suite's configs)

from rlhf_dist.demo import arithmetic_demo, smollm2  # noqa: E402
from rlhf_dist.distributed.weight_sync import free_port  # noqa: E402

TOKEN_ENV = "RLHF_DIST_BENCH_SERVER_TOKEN"


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
    tree["generation"] |= {"environment": "async_overlap:chat_episode",
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


def train(tree: dict, workdir: Path, threads: int) -> list[dict]:
    """Run the GRPO stage in its own process -> its metrics rows."""
    config = workdir / f"{Path(tree['run']['output_dir']).name}.yaml"
    config.write_text(json.dumps(tree))
    here = str(Path(__file__).resolve().parent)  # chat_episode, for --environment
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    env = os.environ | {"OMP_NUM_THREADS": str(threads), "PYTHONPATH": path}
    cmd = [sys.executable, "-m", "rlhf_dist", "ppo", "--config", str(config)]
    subprocess.run(cmd, env=env, check=True)
    lines = (Path(tree["run"]["output_dir"]) / "metrics.jsonl").read_text().splitlines()
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
