"""Every perf.* switch (config.PerfConfig, docs/architecture.md section 10): the speed path
against the plain reference path it replaces, at a tolerance that holds on any CPU and
BLAS build (two code paths may round differently: AVX2 vs AVX-512, packed vs unpacked
MKL kernels), and the same path run twice gives the same bits.

A tiny fp32 Llama with grouped KV heads (2 query heads, 1 KV head), left-padded prompts
of different lengths repeated in groups (GRPO's n samples), right-padded responses.
Generation is compared step by step with the tokens forced (spies.forced_decode): sampled
tokens would compare bits, since a last-bit difference can move a draw across a boundary
of the categorical's CDF.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from spies import forced_decode
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

import rlhf_dist.engine.decode as decode
from rlhf_dist.config import PerfConfig
from rlhf_dist.engine import cpu
from rlhf_dist.models import ActorCritic, ValueModel

V, P, T, TEMPERATURE = 48, 6, 5, 0.7
TOL = {"rtol": 1e-5, "atol": 1e-6}
ON = PerfConfig()  # every speed path on (packed_sequences too, below)
OFF = PerfConfig.reference()

# Where each switch is compared with its reference path: here, or the test named.
ELSEWHERE = {
    "old_logprobs_from_update": "tests/integration/test_integration_no_redundant_forward.py",
    "gather_for_generation": "tests/distributed/test_dist_ppo.py (2-rank ZeRO-3, gathered "
    "and per-layer generation)",
    "gather_for_training": "tests/distributed/test_dist_split_invariance.py (gradients to "
    "1e-6 with and without the gather, 2 ZeRO-3 ranks)",
    "num_threads": "a thread count, not a path: same code, other OpenMP partitioning",
}
HERE = {
    "logprob_chunk_tokens",
    "packed_sequences",
    "shared_prompt_forward",
    "packed_linears",
    "grouped_kv_attention",
    "retain_host_memory",
}


def test_every_switch_is_compared_with_its_reference_path():
    fields = {f.name for f in dataclasses.fields(PerfConfig)}
    assert fields == HERE | set(ELSEWHERE), fields ^ (HERE | set(ELSEWHERE))
    ref = PerfConfig.reference()
    for name in fields - {"num_threads"}:
        assert getattr(ref, name) != getattr(PerfConfig(), name) or name == "packed_sequences"


def llama_config(**extra) -> LlamaConfig:
    config = LlamaConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=64, max_position_embeddings=64,
        attention_dropout=0.0, pad_token_id=0, eos_token_id=1, **extra,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    return config


def tiny_lm(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config()).eval()


def rollout_batch(groups: int = 3, n: int = 3):
    """(input_ids, attention_mask, response_mask) of groups x n rows: prompt g (real
    length P - 2g, left-padded) n times in a row, responses of lengths 5, 4, 3, ..."""
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(2, V, (groups, P), generator=g).repeat_interleave(n, 0)
    lengths = (P - 2 * torch.arange(groups)).clamp(min=1).repeat_interleave(n)
    prompt_mask = (torch.arange(P) >= P - lengths[:, None]).long()
    responses = torch.randint(2, V, (groups * n, T), generator=g)
    response_mask = torch.arange(T) < (T - torch.arange(groups * n) % T).clamp(min=1)[:, None]
    ids = torch.cat([prompts * prompt_mask, responses.masked_fill(~response_mask, 0)], 1)
    return ids, torch.cat([prompt_mask, response_mask.long()], 1), response_mask


def actor_pass(perf: PerfConfig, seed: int = 0):
    """Log-probs, entropies and every gradient of one ActorCritic actor pass (training
    mode, grad on) with `perf`; the loss weights each log-prob by a fixed random number."""
    lm = tiny_lm(seed).train()
    ids, attention, mask = rollout_batch()
    lp, ent, _ = ActorCritic(lm, None, perf)(ids, attention, mask, TEMPERATURE, True)
    w = torch.randn(lp.shape, generator=torch.Generator().manual_seed(2))
    ((lp * w).sum() + ent.sum()).backward()
    grads = {n: p.grad for n, p in lm.named_parameters() if p.grad is not None}
    return lp.detach(), ent.detach(), grads


def assert_same_pass(a, b):
    torch.testing.assert_close(a[0], b[0], **TOL)
    torch.testing.assert_close(a[1], b[1], **TOL)
    assert a[2].keys() == b[2].keys() and len(a[2]) > 0
    for name in a[2]:
        torch.testing.assert_close(a[2][name], b[2][name], **TOL, msg=name)


@pytest.mark.parametrize(
    "switch",
    [
        {"logprob_chunk_tokens": 4},  # 4 tokens a chunk vs the whole logits at once
        {"packed_sequences": True},
        {"shared_prompt_forward": True},
        {"logprob_chunk_tokens": 4, "packed_sequences": True},
    ],
    ids=lambda s: "+".join(s),
)
def test_actor_pass_equals_the_reference_path(switch):
    fast = actor_pass(dataclasses.replace(OFF, **switch))
    assert_same_pass(fast, actor_pass(OFF))
    again = actor_pass(dataclasses.replace(OFF, **switch))  # the same path twice: bits
    assert all(torch.equal(x, y) for x, y in zip(fast[:2], again[:2]))


def test_value_model_packed_equals_padded():
    torch.manual_seed(0)
    classifier = LlamaForSequenceClassification(llama_config(num_labels=1)).eval()
    ids, attention, _ = rollout_batch()
    packed = ValueModel(classifier, dataclasses.replace(OFF, packed_sequences=True))
    padded = ValueModel(classifier, OFF)
    with torch.no_grad():
        got, want = packed(ids, attention), padded(ids, attention)
    real = attention.bool()
    torch.testing.assert_close(got[real], want[real], **TOL)


def decode_logits(monkeypatch, lm, perf: PerfConfig) -> list[torch.Tensor]:
    """Each decode step's logits (B, V) of `generate` over the batch's prompts with the
    tokens forced, under `perf`."""
    ids, attention, _ = rollout_batch()
    seen = forced_decode(monkeypatch, decode, vocab=V)
    gen = SimpleNamespace(max_new_tokens=6, min_new_tokens=6, temperature=1.0, top_k=0, top_p=1.0)
    tok = SimpleNamespace(pad_token_id=0, eos_token_id=1)
    decode.generate(lm, ids[:, :P], attention[:, :P], gen, tok, perf=perf)
    assert len(seen) == 6
    return list(seen)


@pytest.mark.parametrize(
    "switch", ["shared_prompt_forward", "packed_linears", "grouped_kv_attention"]
)
def test_decode_steps_equal_the_reference_path(monkeypatch, switch):
    lm = tiny_lm()
    fast = decode_logits(monkeypatch, lm, dataclasses.replace(OFF, **{switch: True}))
    plain = decode_logits(monkeypatch, lm, OFF)
    for a, b in zip(fast, plain):
        torch.testing.assert_close(a, b, **TOL)
    again = decode_logits(monkeypatch, lm, dataclasses.replace(OFF, **{switch: True}))
    assert all(torch.equal(a, b) for a, b in zip(fast, again))


def test_grouped_kv_attention_copies_no_kv_head_and_restores_the_hook(monkeypatch):
    from transformers.integrations import sdpa_attention

    lm, (ids, attention, _) = tiny_lm(), rollout_batch()
    copies, repeat = [], sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda x, n: copies.append(n) or repeat(x, n))
    original = sdpa_attention.use_gqa_in_sdpa
    with torch.no_grad():
        with cpu.scoring_context(ON):
            assert sdpa_attention.use_gqa_in_sdpa is not original
            lm(input_ids=ids, attention_mask=attention)
        assert copies == [] and sdpa_attention.use_gqa_in_sdpa is original
        with cpu.scoring_context(OFF):
            lm(input_ids=ids, attention_mask=attention)
    assert copies  # the reference path copies: the check above can fail


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="MKL's packed sgemm")
def test_packed_linears_products_and_restored_modules():
    """The fp32 linears compute from MKL-packed weights inside the context: F.linear's
    products to fp32 rounding for the packed row count, another one and a 3-d input; the
    float64 one is left alone; every module is plain again after; autocast entered
    inside gives the module's own (bf16) product."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(8, 6), torch.nn.Linear(6, 5, bias=False), torch.nn.Linear(5, 3)
    )
    net[2].double()
    inputs = [torch.randn(4, 8), torch.randn(7, 8), torch.randn(2, 2, 8)]
    with torch.no_grad():
        want = [net[1](net[0](x)) for x in inputs]
        with cpu.packed_linears(net, rows=4):
            assert "forward" in vars(net[0]) and "forward" in vars(net[1])
            assert "forward" not in vars(net[2])
            got = [net[1](net[0](x)) for x in inputs]
        with cpu.packed_linears(net, rows=4):
            again = [net[1](net[0](x)) for x in inputs]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16 = net[1](net[0](inputs[0]))
        with cpu.packed_linears(net, rows=4), torch.autocast("cpu", dtype=torch.bfloat16):
            bf16_inside = net[1](net[0](inputs[0]))
    for g, w, a in zip(got, want, again):
        assert g.is_contiguous() and g.shape == w.shape and torch.equal(g, a)
        torch.testing.assert_close(g, w, **TOL)
    assert not any("forward" in vars(m) for m in net)
    assert bf16_inside.dtype == torch.bfloat16 and torch.equal(bf16_inside, bf16)


def test_packed_linears_leave_what_they_cannot_pack(monkeypatch):
    """No packing for a ZeRO-3 partitioned weight (whole only while its module runs),
    under autocast, above PACK_LIMIT_BYTES of linear weights, or without MKL."""
    net = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 5))
    net[0].weight.ds_id = 0  # what DeepSpeed marks its partitioned parameters with
    if torch.backends.mkl.is_available():
        with cpu.packed_linears(net, rows=2):
            assert ["forward" in vars(m) for m in net] == [False, True]
    with torch.autocast("cpu", dtype=torch.bfloat16), cpu.packed_linears(net, rows=2):
        assert not any("forward" in vars(m) for m in net)
    monkeypatch.setattr(cpu, "PACK_LIMIT_BYTES", 6 * 5 * 4 - 1)
    with cpu.packed_linears(net, rows=2):
        assert not any("forward" in vars(m) for m in net)
    monkeypatch.setattr(cpu, "PACK_LIMIT_BYTES", 2**30)
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: False)
    with cpu.packed_linears(net, rows=2):
        assert not any("forward" in vars(m) for m in net)


@pytest.mark.parametrize("on", [True, False])
def test_retain_host_memory_is_applied_only_when_on(monkeypatch, on):
    """A process setting, no computation: with the switch off glibc keeps its defaults
    (what retain_freed_host_memory changes: tests/unit/test_unit_distributed_pieces.py);
    never on a GPU process."""
    calls = []
    monkeypatch.setattr(cpu, "retain_freed_host_memory", lambda: calls.append(1) or True)
    perf = dataclasses.replace(OFF, retain_host_memory=on)
    assert cpu.apply_host_memory_setting(perf, torch.device("cpu")) == on
    assert not cpu.apply_host_memory_setting(perf, torch.device("cuda", 0))
    assert calls == ([1] if on else [])
