"""The rollout server's pieces that need no server (docs/serving.md): its config keys,
`rlhf-dist serve` without a token, the weight buckets, the client's response layout."""

from __future__ import annotations

import threading

import pytest
import torch

from rlhf_dist import cli
from rlhf_dist.config import ConfigError, load_config, validate
from rlhf_dist.distributed.weight_sync import SyncGroup, dtype_name, free_port, weight_buckets
from rlhf_dist.errors import ServerError
from rlhf_dist.generation.server import _padded

PPO = ["model.policy=p", "data.train=t.jsonl", "reward.function=m:f"]


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["generation.backend=server"], "generation.server_urls"),
        (["generation.server_urls=[http://127.0.0.1:8000]"], "generation.server_urls"),
        (["generation.backend=server", "generation.server_urls=[127.0.0.1:8000]"], "generation.server_urls"),
        (["generation.environment_endpoint=true"], "generation.environment_endpoint: needs generation.environment"),
        (["generation.environment=m:f", "generation.environment_endpoint=true"], "generation.environment_endpoint: needs generation.backend=server"),
        (["generation.backend=server", "generation.server_urls=[http://h:1]", "generation.environment=m:f", "generation.environment_endpoint=true", "run.eval_every=1", "data.eval=e.jsonl"], "run.eval_every"),
        (["generation.backend=server", "generation.server_urls=[http://h:1]", "lora.enabled=true", "lora.load_in_4bit=true"], "generation.backend=server: not with lora.load_in_4bit"),
        (["generation.server_sync_tolerance=0"], "generation.server_sync_tolerance"),
        (["generation.server_sync_bucket_mb=-1"], "generation.server_sync_bucket_mb"),
        (["serve.port=0"], "serve.port"),
        (["serve.max_batch=0"], "serve.max_batch"),
    ],
)  # fmt: skip
def test_server_keys_refuse_bad_values_naming_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(load_config(None, [*PPO, *overrides]), "ppo")


def test_an_endpoint_environment_is_refused_by_rlhf_dist_eval():
    keys = ["generation.backend=server", "generation.server_urls=[http://h:1]",
            "generation.environment=m:f", "generation.environment_endpoint=true"]  # fmt: skip
    validate(load_config(None, [*PPO, *keys]), "ppo")
    with pytest.raises(ConfigError, match=r"^generation\.environment_endpoint: rlhf-dist eval"):
        validate(load_config(None, [*PPO, *keys]), "eval")


def test_server_backend_accepts_several_urls():
    urls = "generation.server_urls=[http://127.0.0.1:8000,http://10.0.0.2:8001]"
    validate(load_config(None, [*PPO, "generation.backend=server", urls]), "ppo")


def test_serve_without_its_token_is_one_line_and_exit_2(capsys, monkeypatch):
    monkeypatch.delenv("RLHF_DIST_UNSET_TOKEN", raising=False)
    code = cli.main(["serve", "model.policy=nowhere", "serve.token_env=RLHF_DIST_UNSET_TOKEN"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert "serve.token_env" in err and "RLHF_DIST_UNSET_TOKEN" in err


def test_weight_buckets_are_bounded_and_count_zero3_partitions_whole():
    tensors = [("a", torch.zeros(100)), ("b", torch.zeros(100)), ("c", torch.zeros(300))]
    sizes = [[n for n, _ in b] for b in weight_buckets(tensors, bucket_bytes=800)]
    assert sizes == [["a", "b"], ["c"]]  # 400 + 400 bytes, then c alone (over the bound)
    partition = torch.zeros(0)
    partition.ds_numel = 200  # a ZeRO-3 parameter: numel() 0, whole size ds_numel
    named = [("p", partition), ("q", torch.zeros(200))]
    assert [[n for n, _ in b] for b in weight_buckets(named, bucket_bytes=1000)] == [["p"], ["q"]]


def test_dtype_names_and_a_refused_dtype():
    assert dtype_name(torch.bfloat16) == "bfloat16"
    with pytest.raises(ValueError, match="cannot be sent"):
        dtype_name(torch.int64)


def test_a_group_whose_peer_never_joins_times_out_instead_of_hanging():
    with pytest.raises(RuntimeError, match="timeout"):
        SyncGroup("127.0.0.1", free_port(), 0, 2, timeout_s=1)


def test_a_broadcast_whose_sender_never_sends_times_out_instead_of_hanging():
    port, groups = free_port(), {}

    def join(rank):
        groups[rank] = SyncGroup("127.0.0.1", port, rank, 2, timeout_s=1)

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sent = torch.arange(3.0)
    done = threading.Thread(target=groups[0].broadcast, args=(sent,))
    done.start()  # a broadcast that arrives: the group works
    torch.testing.assert_close(groups[1].broadcast(torch.zeros(3)), sent)
    done.join()
    with pytest.raises(RuntimeError, match="(?i)timed out|timeout"):
        groups[1].broadcast(torch.zeros(3))  # rank 0 sends nothing now


def test_responses_are_right_padded_with_zero_log_probs():
    ids, lp = _padded([[5, 6, 7], [8]], [[-0.1, -0.2, -0.3], [-0.5]], pad_id=0, device="cpu")
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    torch.testing.assert_close(lp, torch.tensor([[-0.1, -0.2, -0.3], [-0.5, 0.0, 0.0]]))


def test_a_server_failure_ends_the_command_with_one_line_and_exit_4(capsys, monkeypatch):
    def fail(name, args):
        raise ServerError("post-sync check: http://127.0.0.1:1 scores\nfixed sequences 0.5 away")

    monkeypatch.setattr(cli, "_run_stage", fail)
    assert cli.main(["grpo", "model.policy=p"]) == 4
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlhf-dist grpo: error: post-sync check:") and "\n" not in err


def test_the_client_without_its_token_is_a_config_error_naming_the_key(monkeypatch):
    from rlhf_dist.generation.server import ServerEngine

    monkeypatch.delenv("RLHF_DIST_UNSET_TOKEN", raising=False)
    cfg = load_config(
        None,
        [*PPO, "generation.backend=server", "generation.server_urls=[http://127.0.0.1:1]",
         "generation.server_token_env=RLHF_DIST_UNSET_TOKEN"],
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"generation\.server_token_env: .*RLHF_DIST_UNSET_TOKEN"):
        ServerEngine(cfg, is_main=True, all_max=lambda x: x)


def test_the_sync_walk_gathers_one_bounded_bucket_at_a_time_under_zero3(monkeypatch):
    """A non-sending rank's walk over a ZeRO-3-like model (parameters with ds_id and
    ds_numel, numel() 0): GatheredParameters is entered once per bucket, never nested,
    with at most the bucket bound of whole weights, and covers every weight once."""
    import contextlib

    import deepspeed

    from rlhf_dist.generation.server import ServerEngine

    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])  # 6 x 16.6 KB
    for i, p in enumerate(model.parameters()):
        p.ds_id, p.ds_numel = i, p.numel()
        p.data = torch.zeros(0)  # a partition: nothing of it here
    gathered, live = [], []

    @contextlib.contextmanager
    def recorder(params, modifier_rank=None):
        assert not live  # never two buckets at once
        live.append(params)
        gathered.append([int(p.ds_numel) * 4 for p in params])
        yield
        live.pop()

    monkeypatch.setattr(deepspeed.zero, "GatheredParameters", recorder)
    monkeypatch.setenv("RLHF_DIST_TEST_TOKEN", "t")
    cfg = load_config(
        None,
        ["generation.backend=server", "generation.server_urls=[http://127.0.0.1:1]",
         "generation.server_token_env=RLHF_DIST_TEST_TOKEN",
         f"generation.server_sync_bucket_mb={40_000 / 2**20}"],
    )  # fmt: skip
    ServerEngine(cfg, is_main=False, all_max=lambda x: x)._send(model, with_base=False)
    whole = sum(p.ds_numel * 4 for p in model.parameters())
    assert sum(map(sum, gathered)) == whole and len(gathered) > 1
    assert all(sum(b) <= 40_000 or len(b) == 1 for b in gathered)


def test_memory_growth_keeps_the_largest_rise_over_the_start_while_the_body_runs():
    """weight_sync.MemoryGrowth (memory/sync_peak_mib) over a scripted reading: the
    largest rise above the first reading while the body runs, never a fall; the real
    reading of this process is its resident set."""
    import itertools
    import time

    from rlhf_dist.distributed.weight_sync import MemoryGrowth, memory_in_use

    levels = itertools.chain([100, 90, 164, 130], itertools.repeat(120))
    with MemoryGrowth(torch.device("cpu"), every_s=0.001, read=lambda: next(levels)) as grown:
        time.sleep(0.05)
    assert grown.peak_bytes == 64
    with MemoryGrowth(
        torch.device("cpu"), every_s=0.001, read=itertools.repeat(7).__next__
    ) as flat:
        time.sleep(0.02)
    assert flat.peak_bytes == 0
    assert memory_in_use(torch.device("cpu")) > 2**20


def test_a_lora_sync_sends_the_base_once_then_only_adapters_that_the_server_folds_in():
    """generation/server.py sync_entries + serving/policy.py ServedPolicy._apply: a served
    model holding other weights gets the frozen base whole and the adapters on the first
    sync, only A and B after; each time it then computes what the peft actor computes
    (fp32, 1e-5), the fold never accumulating over syncs. A matrix that does not fit its
    weight is refused."""
    import copy
    import functools
    from types import SimpleNamespace

    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf_dist.config import LoRAConfig
    from rlhf_dist.generation.server import sync_entries
    from rlhf_dist.models.lora import add_adapters
    from rlhf_dist.serving.policy import BadRequest, ServedPolicy, TensorSpec, _check_adapter

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    base = LlamaForCausalLM(cfg).eval()
    served = copy.deepcopy(base)
    with torch.no_grad():  # what the server held before: another run's weights
        for p in served.parameters():
            p.add_(0.1 * torch.randn_like(p))
    lora = LoRAConfig(enabled=True, r=4, alpha=8, target_modules=("q_proj", "v_proj"))
    actor = add_adapters(copy.deepcopy(base), lora, "CAUSAL_LM").eval()
    server = SimpleNamespace(params=dict(served.named_parameters()), bases={}, adapter_parts={})
    apply = functools.partial(ServedPolicy._apply, server)
    ids = torch.randint(0, 64, (2, 9))
    for sync in range(2):
        with torch.no_grad():  # the adapters after some training
            for name, p in actor.named_parameters():
                if "lora_" in name:
                    p.copy_(0.2 * torch.randn_like(p))
        entries = sync_entries(actor, with_base=sync == 0)
        roles = [role for (_, role, _), _ in entries]
        assert roles.count("A") == roles.count("B") == 4  # 2 layers x (q_proj, v_proj)
        assert roles.count("") == (len(server.params) if sync == 0 else 0)
        with torch.no_grad():
            for (name, role, scale), t in entries:
                apply(TensorSpec(name, tuple(t.shape), "float32", role, scale), t.clone())
            assert not server.adapter_parts
            torch.testing.assert_close(served(ids).logits, actor(ids).logits, atol=1e-5, rtol=0)
    with pytest.raises(BadRequest, match="does not fit the weight"):
        _check_adapter(TensorSpec("w", (4, 31), "float32", "A", 2.0), (32, 32))


def tiny_served_policy(tmp_path):
    """A ServedPolicy of a random one-layer Llama over the demo's word-level tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf_dist.config import PerfConfig
    from rlhf_dist.demo.task import build_tokenizer
    from rlhf_dist.serving.policy import ServedPolicy

    tok = build_tokenizer(tmp_path / "tok")
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    torch.manual_seed(0)
    return ServedPolicy(LlamaForCausalLM(cfg), tok, (tok.eos_token_id,), PerfConfig(), "p", 5.0)


def sampling(**keys):
    from rlhf_dist.serving.policy import SamplingRequest

    return SamplingRequest(**({"max_new_tokens": 8, "min_new_tokens": 0, "temperature": 1.0,
                               "top_k": 0, "top_p": 1.0, "seed": 0} | keys))  # fmt: skip


def test_concurrent_requests_are_sampled_as_one_batch_each_as_it_would_alone(tmp_path):
    """serve.batch_window_ms: requests that arrive within the window with the same sampling
    keys are one generate call, each request's rows drawing from its own seed's generator,
    so each gets the tokens it gets alone (log-probs within float rounding of the batched
    forward: a near-tie could flip a token, unlikely at these few tokens); a request with
    other keys is a group of its own; a bad one fails alone; a request that would take
    the batch past max_rows waits for the next."""
    from concurrent.futures import ThreadPoolExecutor

    from rlhf_dist.serving.batching import RequestBatcher
    from rlhf_dist.serving.policy import BadRequest

    policy = tiny_served_policy(tmp_path)
    asks = [([[4, 5, 6 + i]], sampling(seed=10 + i)) for i in range(3)]
    asks.append(([[4, 6], [5, 7, 9]], sampling(seed=20)))  # two prompts: /generate's shape
    asks.append(([[7, 8]], sampling(seed=3, temperature=0.5)))  # other keys: another group
    alone = [policy.generate(prompts, s) for prompts, s in asks]
    calls = []
    generate = policy.generate
    policy.generate = lambda *a: calls.append(len(a[0])) or generate(*a)
    batcher = RequestBatcher(policy, window_s=2.0, max_rows=8)  # room for a loaded CI
    with ThreadPoolExecutor(len(asks)) as pool:
        together = list(pool.map(lambda a: batcher.generate(*a), asks))
    assert sorted(calls) == [1, 5]  # two groups: the four alike (5 prompts), and the other
    for one, batched in zip(alone, together):
        assert batched["responses"] == one["responses"]
        torch.testing.assert_close(batched["logprobs"], one["logprobs"], atol=1e-5, rtol=0)
    with pytest.raises(BadRequest, match="prompts"):
        batcher.generate([[10**6]], sampling())
    calls.clear()
    small = RequestBatcher(policy, window_s=2.0, max_rows=2)
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda a: small.generate(*a), asks[:3]))
    assert sorted(calls) == [1, 2]  # the third did not fit: the next batch


def test_an_update_that_stops_half_way_is_never_served(tmp_path):
    """A trainer that dies mid-broadcast leaves some buckets of its update written and the
    rest never sent: those weights are neither version, so /generate and /score answer
    Unavailable (a 503) naming the update and the error, until a whole update (the resumed
    trainer's first sync) is in; then the new version is served."""
    from rlhf_dist.serving.policy import TensorSpec, Unavailable

    policy = tiny_served_policy(tmp_path)

    class Group:  # the trainer's broadcasts: `alive` tensors, then its connection is gone
        device = torch.device("cpu")

        def __init__(self, alive: int):
            self.alive = alive

        def broadcast(self, t):
            if self.alive == 0:
                raise RuntimeError("Connection closed by peer")
            self.alive -= 1
            return torch.full_like(t, 0.01)

    names = list(policy.params)

    def spec(name):
        return TensorSpec(name, tuple(policy.params[name].shape), "float32")

    ask = sampling(max_new_tokens=3, seed=1)
    assert policy.generate([[4, 5, 6]], ask)["version"] == 0
    policy.group = Group(alive=1)
    policy.receive_bucket(1, [spec(names[0])], final=False)  # written
    policy.receive_bucket(1, [spec(names[1])], final=True)  # its sender died
    with pytest.raises(Unavailable, match=r"update 1 stopped half-way .*Connection closed"):
        policy.generate([[4, 5, 6]], ask)
    with pytest.raises(Unavailable, match="update 1"):
        policy.score([[4, 5, 6]], 1.0)
    assert (policy.version, policy.torn) == (0, 1)
    policy.group = Group(alive=len(names))  # the resumed trainer: every weight, as version 1
    for i, name in enumerate(names):
        policy.receive_bucket(1, [spec(name)], final=i == len(names) - 1)
    assert policy.generate([[4, 5, 6]], ask)["version"] == 1
    assert (policy.version, policy.torn) == (1, 0)
    assert all(bool((p == 0.01).all()) for p in policy.params.values())
