"""A `rlhf-dist serve` process for the tests of the rollout server (not a test module).

`served(tree, token_env, token)` writes the config `tree` (serve.port is set to a free
port, serve.token_env to `token_env`) and starts `python -m rlhf_dist serve` with the token
in its environment; it yields the server's URL once /health answers, and on exit stops
the process and checks that the token never appeared in its output. `client(url,
token_env)` is the trainer's client of such a server (one rank).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def served(
    tree: dict, token_env: str, token: str, start_timeout: float = 90.0,
    server_env: dict | None = None,
):  # fmt: skip
    port = _free_port()
    tree = {**tree, "serve": {**tree.get("serve", {}), "port": port, "token_env": token_env}}
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "serve.yaml"
        config.write_text(json.dumps(tree))
        env = os.environ | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", token_env: token}
        # The output goes to a file: a pipe nobody reads until the end fills at 64 KiB
        # and then blocks the server mid-request.
        log = Path(tmp) / "serve.log"
        with log.open("w") as sink:
            proc = subprocess.Popen(
                [sys.executable, "-m", "rlhf_dist", "serve", "--config", str(config)],
                env=env | (server_env or {}), stdout=sink, stderr=subprocess.STDOUT,
            )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(url, proc, start_timeout, log)
            yield url
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            assert token not in log.read_text(errors="replace")  # never in the server's output


def served_tiny_policy(policy, token_env: str, token: str):
    """`served` for a tiny test policy: batches of up to 16, one thread, a 60 s timeout;
    a context manager giving the server's URL."""
    tree = {"model": {"policy": str(policy)}, "serve": {"max_batch": 16},
            "perf": {"num_threads": 1}, "distributed": {"timeout_s": 60}}  # fmt: skip
    return served(tree, token_env, token)


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    from rlhf_dist.generation.server import wait_healthy

    if not wait_healthy(url, timeout, lambda: proc.poll() is None):
        proc.kill()
        proc.wait()
        out = log.read_text(errors="replace")
        raise RuntimeError(f"rlhf-dist serve did not start: {out[-2000:]}")


def client(url: str, token_env: str, timeout_s: int = 60, **generation):
    """The trainer's ServerEngine for the server at `url` (one rank), with `generation` keys."""
    from rlhf_dist.config import config_from_dict
    from rlhf_dist.generation.server import ServerEngine

    cfg = config_from_dict(
        {"generation": {"backend": "server", "server_urls": [url], "server_token_env": token_env,
                        **generation},
         "distributed": {"timeout_s": timeout_s}}
    )  # fmt: skip
    return ServerEngine(cfg, is_main=True, all_max=lambda x: x)
