"""The weight-sync group's choice of backend and what surrounds its CUDA path, on CPU
(docs/serving.md, "Weight sync"): NCCL only when trainer rank 0 and every server are on
CUDA, the handshake that carries the choice to the servers, bucket plans made from the
metadata of CUDA dtypes (sizes only, no memory), and the refusals of a backend a process
cannot join. The gloo path's timeouts are tests/unit/test_unit_serve.py's."""

from __future__ import annotations

import random

import pytest
import torch

from rlhf_dist.config import load_config
from rlhf_dist.distributed import weight_sync
from rlhf_dist.distributed.weight_sync import (
    SyncGroup,
    free_port,
    local_backends,
    sync_backend,
    weight_buckets,
)
from rlhf_dist.generation import server as server_module
from rlhf_dist.generation.server import ServerEngine

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")
BOTH, GLOO = ["gloo", "nccl"], ["gloo"]


def test_nccl_is_chosen_only_when_the_trainer_and_every_server_are_on_cuda(monkeypatch):
    monkeypatch.setattr(weight_sync, "local_backends", lambda: BOTH)  # rank 0 has NCCL
    assert sync_backend(CUDA, [BOTH, BOTH]) == "nccl"
    assert sync_backend(CUDA, [BOTH, GLOO]) == "gloo"  # one server on CPU
    assert sync_backend(CPU, [BOTH]) == "gloo"  # the actor's weights on CPU
    monkeypatch.setattr(weight_sync, "local_backends", lambda: GLOO)  # torch without NCCL
    assert sync_backend(CUDA, [BOTH]) == "gloo"


def test_this_machine_offers_nccl_only_with_a_gpu_and_nccl():
    can = torch.cuda.is_available() and torch.distributed.is_nccl_available()
    assert local_backends() == (BOTH if can else GLOO)


def _engine(monkeypatch, urls: int) -> ServerEngine:
    monkeypatch.setenv("RLHF_DIST_TEST_TOKEN", "t")
    servers = ",".join(f"http://127.0.0.1:{i + 1}" for i in range(urls))
    cfg = load_config(
        None,
        ["generation.backend=server", f"generation.server_urls=[{servers}]",
         "generation.server_token_env=RLHF_DIST_TEST_TOKEN"],
    )  # fmt: skip
    return ServerEngine(cfg, is_main=True, all_max=lambda x: x)


def test_the_handshake_carries_the_backend_to_every_server_and_rejoins_when_it_changes(
    monkeypatch,
):
    """Rank 0 reads each server's /health (`sync_backends`, `sync_group`, `version`), picks
    the backend, sends it in every /init_weight_sync (server i: rank i + 1 of 1 + n), and
    makes the group again when a server holds none or the backend changes; the new
    version is one above the last synced and the highest any server reports."""
    engine = _engine(monkeypatch, urls=2)
    health = {"version": 3, "sync_group": False, "sync_backends": BOTH}
    joins = []

    def call(url, path, body=None):
        if path == "/init_weight_sync":
            joins.append((url, body))
        return dict(health) if path == "/health" else {"joining": True}

    class Group:  # what SyncGroup would make, without a peer
        def __init__(self, address, port, rank, world, timeout_s, backend):
            assert (rank, world) == (0, 3)
            self.backend = backend

    monkeypatch.setattr(engine, "call", call)
    monkeypatch.setattr(server_module, "SyncGroup", Group)
    monkeypatch.setattr(weight_sync, "local_backends", lambda: BOTH)
    engine._begin(CUDA)
    assert [(b["rank"], b["world_size"], b["backend"]) for _, b in joins] == [
        (1, 3, "nccl"),
        (2, 3, "nccl"),
    ]
    assert engine.version == 4 and engine.joined
    health["sync_group"], engine.joined = True, False
    joins.clear()
    engine._begin(CUDA)  # joined, same backend: the group is kept
    assert not joins and not engine.joined
    engine._begin(CPU)  # the actor moved to the CPU: a gloo group
    assert {b["backend"] for _, b in joins} == {"gloo"} and engine.group.backend == "gloo"
    health["sync_group"] = False  # a server restarted: it holds no group, version 0
    health["version"], joins = 0, []
    engine.version = 7  # the last sync's: the next is above it, not above the servers' 0
    engine._begin(CPU)
    assert len(joins) == 2 and engine.joined and engine.version == 8


def _meta(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A ZeRO-3-like partition of a CUDA weight: no memory, numel() 0, whole size ds_numel."""
    t = torch.empty(0, dtype=dtype, device="meta")
    t.ds_numel = numel
    return t


def test_buckets_are_planned_from_cuda_dtype_metadata_alone():
    """Hand case, bound 1000 bytes: a 300 bf16 (600 B) + b 200 fp16 (400 B) fill the bound
    exactly; c 100 fp32 (400 B) starts the next; d 1000 bf16 (2000 B) is over it, alone."""
    named = [
        ("a", _meta(300, torch.bfloat16)),
        ("b", _meta(200, torch.float16)),
        ("c", _meta(100, torch.float32)),
        ("d", _meta(1000, torch.bfloat16)),
    ]
    plan = [[n for n, _ in b] for b in weight_buckets(named, bucket_bytes=1000)]
    assert plan == [["a", "b"], ["c"], ["d"]]


@pytest.mark.parametrize("seed", range(5))
def test_bucket_plans_keep_order_and_the_bound_for_any_sizes(seed):
    """Property: the buckets are the weights in order, each within the bound in whole
    bytes unless a single weight is over it, and no two neighbours would fit in one."""
    rng = random.Random(seed)
    dtypes = [torch.bfloat16, torch.float16, torch.float32]
    named = [(i, _meta(rng.randint(1, 5000), rng.choice(dtypes))) for i in range(40)]
    bound = rng.randint(1000, 20000)
    plan = list(weight_buckets(named, bound))
    assert [k for b in plan for k, _ in b] == list(range(40))
    sizes = [sum(t.ds_numel * t.element_size() for _, t in b) for b in plan]
    assert all(s <= bound or len(b) == 1 for s, b in zip(sizes, plan))
    firsts = [b[0][1].ds_numel * b[0][1].element_size() for b in plan[1:]]
    assert all(s + f > bound for s, f in zip(sizes, firsts))


def test_a_group_refuses_a_backend_it_cannot_join():
    with pytest.raises(ValueError, match="backend 'mpi' is not one of"):
        SyncGroup("127.0.0.1", free_port(), 0, 2, timeout_s=1, backend="mpi")
    if "nccl" in local_backends():
        pytest.skip("this machine has NCCL and a GPU (launch/bench/gpu_suite.sh checks it)")
    with pytest.raises(RuntimeError, match="NCCL asked for, but this torch has no NCCL or no GPU"):
        SyncGroup("127.0.0.1", free_port(), 0, 2, timeout_s=1, backend="nccl")


def test_a_gloo_group_sends_from_and_receives_into_the_cpu():
    group = SyncGroup("127.0.0.1", free_port(), 0, 1, timeout_s=5)  # world 1: rank 0 alone
    assert group.device == CPU and group.backend == "gloo"
    sent = group.placed(torch.arange(6.0).reshape(2, 3).t())  # a transposed view
    assert sent.is_contiguous() and sent.device == CPU
    torch.testing.assert_close(group.broadcast(sent), torch.arange(6.0).reshape(2, 3).t())


class _Gone:
    """A group whose peer is gone: every broadcast raises as torch's DistError does."""

    backend, device = "gloo", CPU

    def placed(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().contiguous()

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("Connection closed by peer\n(the rest of torch's message)")


def test_a_failed_broadcast_drops_the_group_on_both_sides_so_the_next_sync_rejoins(
    monkeypatch, tmp_path
):
    """A group whose broadcast failed is unusable (gloo's pairs are out of step): the
    trainer forgets it, and the server reports none in /health, so the next sync's
    handshake (`_begin`) makes a new group instead of reusing the broken one."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf_dist.config import PerfConfig
    from rlhf_dist.demo.task import build_tokenizer
    from rlhf_dist.errors import ServerError
    from rlhf_dist.serving.policy import ServedPolicy, TensorSpec

    engine = _engine(monkeypatch, urls=1)
    engine.group = _Gone()
    monkeypatch.setattr(engine, "call", lambda url, path, body=None: {})
    with pytest.raises(ServerError, match="rollout servers failed: Connection closed by peer$"):
        engine._send_bucket([(("w", "", 1.0), torch.zeros(3))], final=True)
    assert engine.group is None

    tok = build_tokenizer(tmp_path / "tok")
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    policy = ServedPolicy(LlamaForCausalLM(cfg), tok, (tok.eos_token_id,), PerfConfig(), "p", 5)
    policy.group = _Gone()
    name, param = next(iter(policy.params.items()))
    policy.receive_bucket(1, [TensorSpec(name, tuple(param.shape), "float32")], final=True)
    assert isinstance(policy.pending[-1].exception(timeout=30), RuntimeError)
    assert policy.group is None and "Connection closed by peer" in policy.last_error
    assert policy.version == 0 and policy.torn == 0  # nothing was written
