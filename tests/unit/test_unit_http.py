"""The one HTTP transport (rlhf_dist/http_client.py) against a local stub server:
connections are pooled and reused, error answers, refusals and answers that are not JSON keep the words
callers put in their messages (the rollout servers' client's shown here; the remote
rewards' are tests/unit/test_unit_rewards.py's), and every call is bounded by the timeout
even with more calls in flight than pooled connections."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from http_stub import StubServer

from rlhf_dist.config import load_config
from rlhf_dist.distributed.weight_sync import free_port
from rlhf_dist.errors import ServerError
from rlhf_dist.generation.server import ServerEngine
from rlhf_dist.http_client import HTTPFailure, JSONClient


def test_calls_one_after_another_reuse_one_pooled_connection():
    with StubServer(lambda path, body, headers: (200, {"echo": body}), keep_alive=True) as stub:
        http = JSONClient(timeout_s=10)
        answers = [http.call(stub.url + "/x", {"i": i}, {"X-Run": "r"}) for i in range(5)]
        http.close()
    assert [a["echo"]["i"] for a in answers] == list(range(5))
    assert len(set(stub.ports)) == 1  # one TCP connection for the five calls
    _, _, headers = stub.requests[0]
    assert headers["Content-Type"] == "application/json" and headers["X-Run"] == "r"


def test_failures_keep_the_status_and_detail_or_the_reason():
    def answer(path, body, headers):
        return (503, {"detail": "weights: update 4 stopped half-way"}) if path == "/e" else (
            200, b"<html>not json</html>")  # fmt: skip

    http = JSONClient(timeout_s=5)
    with StubServer(answer) as stub:
        with pytest.raises(HTTPFailure, match=r"^HTTP 503 .*update 4 stopped half-way") as e:
            http.call(stub.url + "/e", {})
        assert e.value.status == 503
        with pytest.raises(HTTPFailure, match="^the answer is not JSON$") as e:
            http.call(stub.url + "/html", {})
        assert e.value.status is None
    with pytest.raises(HTTPFailure, match="(?i)connection refused") as e:
        http.call(f"http://127.0.0.1:{free_port()}/x")  # nobody listens there
    assert e.value.status is None


def test_every_call_is_bounded_by_the_timeout_with_more_in_flight_than_connections():
    """Four calls, two pooled connections, a server that answers after 5 s: the two that
    got a connection time out reading, the two waiting for one time out in the pool; all
    four within about the 0.5 s timeout, none waits for the answers."""
    release = threading.Event()

    def slow(path, body, headers):
        release.wait(5)
        return 200, {}

    http = JSONClient(timeout_s=0.5, max_connections=2)
    with StubServer(slow) as stub:
        start = time.monotonic()
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(http.call, stub.url + "/slow", {}) for _ in range(4)]
            errors = [f.exception() for f in futures]
        elapsed = time.monotonic() - start
        release.set()
    assert all(isinstance(e, HTTPFailure) and str(e) == "timed out" for e in errors), errors
    assert elapsed < 4.0  # 5 s if any call waited for the answer (room for a loaded machine)


def test_the_rollout_servers_client_words_its_errors_as_before(monkeypatch):
    monkeypatch.setenv("RLHF_DIST_TEST_TOKEN", "t0k")
    with StubServer(lambda path, body, headers: (401, {"detail": "wrong token"})) as stub:
        cfg = load_config(
            None,
            ["generation.backend=server", f"generation.server_urls=[{stub.url}]",
             "generation.server_token_env=RLHF_DIST_TEST_TOKEN", "distributed.timeout_s=3"],
        )  # fmt: skip
        engine = ServerEngine(cfg, is_main=True, all_max=lambda x: x)
        with pytest.raises(ServerError, match=r"^rollout server http://.*/score: HTTP 401 .*wrong"):
            engine.call(stub.url, "/score", {"sequences": []})
        assert stub.requests[0][2]["Authorization"] == "Bearer t0k"
    gone = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerError, match=r"^rollout server http://.*/health: .*\(within 3 s\)$"):
        engine.call(gone, "/health")
