"""A rollout server that restarts rejoins at the trainer's current version before it is
used (docs/serving.md, "Weight sync"): the servers here run in this process (the FastAPI
app under uvicorn on a thread, a tiny random Llama), so a restart is a new server on the
same port in a second, with nothing of the old one's weights or group.

- the first sync joins a gloo group (the handshake's choice on CPU) and serves version 1;
- the restarted server holds its start-up weights at version 0: an answer it gives before
  the next sync is refused by the version check, never trained on;
- the next sync sees it holds no group, makes the group again, sends every weight and
  moves it to version 2, the trainer's weights exactly (the post-sync check passes);
- a server refuses a backend it cannot join (NCCL on a CPU-only machine) with a 400.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from serve_process import client

from rlhf_dist.config import PerfConfig, config_from_dict
from rlhf_dist.data.rows import left_pad
from rlhf_dist.demo.task import build_tokenizer
from rlhf_dist.distributed.weight_sync import free_port, local_backends
from rlhf_dist.errors import ServerError
from rlhf_dist.serving.app import build_app
from rlhf_dist.serving.policy import ServedPolicy

TOKEN, ENV = "rejoin-token-3f9a", "RLHF_DIST_TEST_REJOIN_TOKEN"


def _llama(tokenizer, seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


@contextlib.contextmanager
def _serving(policy: ServedPolicy, port: int) -> Iterator[str]:
    """`policy` behind the server's app on 127.0.0.1:`port` until the block ends."""
    import uvicorn

    app = build_app(policy, TOKEN, max_batch=8, max_new_tokens=16)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture
def tokenizer(tmp_path):
    return build_tokenizer(tmp_path / "tok")


def test_a_restarted_server_rejoins_at_the_current_version_before_it_is_used(
    tokenizer, monkeypatch
):
    monkeypatch.setenv(ENV, TOKEN)
    port, stops, pad = free_port(), (tokenizer.eos_token_id,), tokenizer.pad_token_id

    def started() -> ServedPolicy:  # a server process's start: the weights on its disk
        model = _llama(tokenizer, seed=0)
        return ServedPolicy(model, tokenizer, stops, PerfConfig(), "p", timeout_s=20.0)

    actor = _llama(tokenizer, seed=1)  # the trainer's weights: not the served ones
    ids, mask = left_pad([[4, 5, 6], [7, 8]], pad)
    greedy = config_from_dict({"generation": {"max_new_tokens": 4, "top_k": 1}}).generation
    with _serving(started(), port) as url:
        engine = client(url, ENV, timeout_s=20)
        engine.load_weights(actor)
        assert engine.version == 1 and engine.group is not None
        assert engine.group.backend == "gloo"  # CPU on both sides
        first_group = engine.group
    restarted = started()
    with _serving(restarted, port):
        with pytest.raises(ServerError, match="policy version 0, the trainer synced version 1"):
            engine.generate(ids, mask, greedy, stops, pad)
        engine.load_weights(actor)  # its /health: no group, version 0 -> rejoin, every weight
        assert engine.group is not first_group and restarted.group is not None
        assert (engine.version, restarted.version, restarted.torn) == (2, 2, 0)
        served = restarted.model.state_dict()
        for name, weight in actor.state_dict().items():
            torch.testing.assert_close(served[name], weight, atol=0, rtol=0)
        response, _ = engine.generate(ids, mask, greedy, stops, pad)  # version 2: accepted
        assert response.shape[0] == 2


def test_a_server_refuses_a_backend_it_cannot_join(tokenizer):
    if "nccl" in local_backends():
        pytest.skip("this machine can join NCCL")
    from rlhf_dist.http_client import HTTPFailure, JSONClient

    policy = ServedPolicy(
        _llama(tokenizer, 0), tokenizer, (tokenizer.eos_token_id,), PerfConfig(), "p", 5.0
    )
    with _serving(policy, free_port()) as url:
        http, auth = JSONClient(10), {"Authorization": f"Bearer {TOKEN}"}
        assert http.call(url + "/health")["sync_backends"] == ["gloo"]
        body = {"address": "127.0.0.1", "port": 1, "rank": 1, "world_size": 2, "backend": "nccl"}
        with pytest.raises(HTTPFailure, match=r"HTTP 400 .*backend: 'nccl' is not one this"):
            http.call(url + "/init_weight_sync", body, auth)
        assert policy.group is None  # nothing was queued
