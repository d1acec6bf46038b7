"""Request overhead of the trainer's rollout-server client (generation/server.py
`ServerEngine.call`) against the serve tests' tiny server (the demo's tiny random policy,
one thread): milliseconds per call of GET /health (no model work) and of POST /score of
two 16-token sequences (one tiny forward), one caller after another and k callers at once
(k = 1 and 4: the requests in flight under ppo.max_staleness). Run it with whichever
transport the checkout has; the figures are in docs/serving.md ("HTTP client").

Usage: python launch/bench/http_overhead.py [--calls 200] [--out runs/bench/http]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import TOKEN_ENV, start_server  # noqa: E402

from rlhf_dist.config import config_from_dict  # noqa: E402
from rlhf_dist.demo import task  # noqa: E402
from rlhf_dist.distributed.weight_sync import free_port  # noqa: E402
from rlhf_dist.generation.server import ServerEngine  # noqa: E402


def timed(call: Callable[[], object], calls: int, at_once: int) -> float:
    """Median milliseconds per call over `calls` calls, `at_once` callers in flight
    (the wall time of each round of `at_once` concurrent calls, divided by `at_once`)."""
    rounds = []
    with ThreadPoolExecutor(at_once) as pool:
        for _ in range(max(1, calls // at_once)):
            start = time.perf_counter()
            list(pool.map(lambda _: call(), range(at_once)))
            rounds.append((time.perf_counter() - start) * 1000 / at_once)
    return statistics.median(rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
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
            for name, call in [
                ("GET /health", lambda: engine.call(url, "/health")),
                ("POST /score", lambda: engine.call(url, "/score", seqs)),
            ]:
                for _ in range(10):  # warm-up: first connections, the model's first forward
                    call()
                for k in (1, 4):
                    ms = timed(call, args.calls, k)
                    print(f"http_overhead: {name} k={k} ms_per_call={ms:.3f}", flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
