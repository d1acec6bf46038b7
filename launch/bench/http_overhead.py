"""Request overhead of the trainer's rollout-server client (generation/server.py
`ServerEngine.call`) against the serve tests' tiny server (the demo's tiny random policy,
one thread): milliseconds per call of GET /health (no model work) and of POST /score of
two 16-token sequences (one tiny forward), one caller after another and k callers at once
(k = 1 and 4: the requests in flight under ppo.max_staleness), through the client's
transport (rlhf_dist/http_client.py, httpx with pooled connections) and through the
standard library's urllib as the client called it before (a new connection per call), alternating
rounds of the two so that both see the same machine load. The figures are in
docs/serving.md ("HTTP client").

Usage: python launch/bench/http_overhead.py [--calls 200] [--out runs/bench/http]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import TOKEN_ENV, start_server  # noqa: E402

from rlhf_dist.config import config_from_dict  # noqa: E402
from rlhf_dist.demo import task  # noqa: E402
from rlhf_dist.distributed.weight_sync import free_port  # noqa: E402
from rlhf_dist.generation.server import ServerEngine  # noqa: E402


def urllib_call(url: str, body: dict | None, token: str, timeout_s: float) -> dict:
    """One call as the client made it on urllib: a new connection each time."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}
    request = urllib.request.Request(url, data, headers)
    with urllib.request.urlopen(request, timeout=timeout_s) as answer:
        return dict(json.loads(answer.read()))


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
                            ms[t].append(timed(call, args.calls // 5, k))
                    figures = " ".join(f"{t}_ms={statistics.median(v):.3f}" for t, v in ms.items())
                    print(f"http_overhead: {name} k={k} {figures}", flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
