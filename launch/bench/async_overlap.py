"""Bounded-staleness rollouts (ppo.max_staleness; docs/serving.md, "Asynchronous rollouts"):
seconds per iteration of the same GRPO work with on-policy rollouts from a rollout server
(max_staleness=0) and one step off-policy (1), and how much of generation and training
overlap.

The work: the arithmetic demo's GRPO stage in its quick size (the real SmolLM2-135M, a
reasoning-gym task, PROMPTS x SAMPLES responses of up to NEW tokens, one optimizer step
per rollout), ITERATIONS iterations, with one `rlhf-dist serve` process of the same model
and one trainer process, THREADS threads each. Both runs start from the same weights and
seed against a freshly started server.

Per iteration (the first dropped: start-up), from each run's metrics.jsonl:
- t_iteration = time/total;
- sync run: t_generate = time/generate (weight sync + the servers' rollout, waited for),
  t_train = time/score + time/update;
- async run: t_generate = time/generate_request (the servers' rollout, requested during
  the previous iteration), t_train = time/score + time/update + time/weight_sync (the
  trainer's own work; the sync cannot overlap a request);
- overlap = (t_generate + t_train - t_iteration) / min(t_generate, t_train): 1 when the
  shorter one is fully hidden behind the longer, 0 when they run one after the other.

Both processes share the machine's cores: on a 2-core box keep THREADS at 1.

Usage: python launch/bench/async_overlap.py [--iterations 6] [--threads 1] [--new 24]
       [--out runs/bench/async]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import start_server  # noqa: E402 (this folder's rollout-server benchmark)

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


def train(tree: dict, workdir: Path, threads: int) -> list[dict]:
    """Run the GRPO stage in its own process -> its metrics rows."""
    config = workdir / f"{Path(tree['run']['output_dir']).name}.yaml"
    config.write_text(json.dumps(tree))
    env = os.environ | {"OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "rlhf_dist", "ppo", "--config", str(config)]
    subprocess.run(cmd, env=env, check=True)
    lines = (Path(tree["run"]["output_dir"]) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "time/total" in r]


def times(rows: list[dict], asynchronous: bool) -> dict[str, float]:
    """Median t_iteration, t_generate, t_train and their overlap over rows[1:]."""
    steady = rows[1:] or rows
    generate = "time/generate_request" if asynchronous else "time/generate"

    def median(f) -> float:
        return statistics.median(f(r) for r in steady)

    t_iteration = median(lambda r: r["time/total"])
    t_generate = median(lambda r: r[generate])
    sync = (lambda r: r["time/weight_sync"]) if asynchronous else (lambda r: 0.0)
    t_train = median(lambda r: r["time/score"] + r["time/update"] + sync(r))
    overlap = (t_generate + t_train - t_iteration) / min(t_generate, t_train)
    score = statistics.mean(r["objective/score"] for r in rows)
    return {"iteration": t_iteration, "generate": t_generate, "train": t_train,
            "overlap": overlap, "score": score}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--new", type=int, default=24, help="max new tokens per response")
    parser.add_argument("--out", default="runs/bench/async")
    args = parser.parse_args()
    os.environ.setdefault(TOKEN_ENV, os.urandom(16).hex())
    policy, out = smollm2.build("shipped"), Path(args.out).resolve()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for staleness in (0, 1):
            port = free_port()
            server = start_server(policy, port, args.threads, Path(tmp))
            try:
                tree = grpo_tree(out, policy, f"http://127.0.0.1:{port}", args, staleness)
                results[staleness] = times(train(tree, Path(tmp), args.threads), staleness == 1)
            finally:
                server.terminate()
                server.wait(timeout=60)
    print(f"GRPO on SmolLM2-135M, one trainer + one server process, {args.threads} thread(s) "
          f"each, {args.iterations} iterations (first dropped), medians in seconds")  # fmt: skip
    print(f"{'ppo.max_staleness':<18} {'s/iteration':>11} {'t_generate':>10} {'t_train':>8} "
          f"{'overlap':>8} {'mean score':>10}")  # fmt: skip
    for staleness, t in results.items():
        print(f"{staleness:<18} {t['iteration']:11.2f} {t['generate']:10.2f} {t['train']:8.2f} "
              f"{t['overlap']:8.2f} {t['score']:10.3f}")  # fmt: skip
    speedup = results[0]["iteration"] / results[1]["iteration"]
    print(f"speed-up of max_staleness=1: {speedup:.2f}x")


if __name__ == "__main__":
    main()
