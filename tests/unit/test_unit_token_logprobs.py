"""engine.forward.token_logprobs, the one sequence log-prob function (docs/architecture.md section
10): equal to the whole-logits computation (the model's own logits, log_softmax at the
temperature, gather) in values and in every parameter's gradient, for untied and tied
embeddings, LoRA on the output head, the module-per-chunk path ZeRO-3 takes, and the
adapters-off reference."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlhf_dist.algo.logprobs import logprobs_and_entropy
from rlhf_dist.config import LoRAConfig, PerfConfig
from rlhf_dist.engine import forward as engine_forward
from rlhf_dist.engine.forward import token_logprobs
from rlhf_dist.engine.packing import position_ids_from
from rlhf_dist.models import ActorCritic
from rlhf_dist.models.lora import AdapterOffReference, add_adapters

V, TEMPERATURE = 50, 0.7


def tiny_lm(tied: bool, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=32, max_position_embeddings=64,
        tie_word_embeddings=tied, attention_dropout=0.0, pad_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def batch(seed: int = 1):
    """Left-padded prompts of 6 then responses of 5 with ragged masks (B = 3)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (3, 11), generator=g)
    attention = torch.ones_like(ids)
    attention[0, :2] = 0  # left padding
    response_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]]).bool()
    attention[:, 6:] = response_mask.long()
    return ids, attention, response_mask


def chunks(n: int) -> PerfConfig:
    """perf with the head in chunks of n tokens (perf.logprob_chunk_tokens)."""
    return PerfConfig(logprob_chunk_tokens=n)


def whole_logits_path(model, ids, attention, response_mask):
    """Today's computation: the model's (B, L, V) logits, sliced, log_softmax, gather."""
    T = response_mask.shape[1]
    logits = model(
        input_ids=ids, attention_mask=attention, position_ids=position_ids_from(attention)
    ).logits[:, -T - 1 : -1]
    lp, ent = logprobs_and_entropy(logits, ids[:, -T:], TEMPERATURE)
    return lp * response_mask, ent * response_mask


def values_and_grads(model, fn, chunk=None):
    ids, attention, mask = batch()
    model.zero_grad(set_to_none=True)
    if fn == "chunked":
        lp, ent = token_logprobs(model, ids, attention, mask, TEMPERATURE, True, perf=chunks(chunk))
    else:
        lp, ent = whole_logits_path(model, ids, attention, mask)
    g = torch.Generator().manual_seed(2)
    weights = torch.randn(lp.shape, generator=g), torch.randn(lp.shape, generator=g)
    ((lp * weights[0]).sum() + (ent * weights[1]).sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp.detach(), ent.detach(), grads


def assert_same(model, chunk):
    lp, ent, grads = values_and_grads(model, "chunked", chunk)
    ref_lp, ref_ent, ref_grads = values_and_grads(model, "full")
    torch.testing.assert_close(lp, ref_lp, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent, ref_ent, atol=1e-6, rtol=1e-6)
    assert grads.keys() == ref_grads.keys() and len(grads) > 0
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-6, rtol=1e-6, msg=name)
    return grads


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_equal_to_the_whole_logits_in_values_and_gradients(tied, chunk):
    model = tiny_lm(tied)
    grads = assert_same(model, chunk)
    assert "lm_head.weight" in grads or tied
    assert "model.embed_tokens.weight" in grads  # the tied head's gradient lands here too


def test_positions_outside_the_mask_are_zero_and_reach_no_head():
    model = tiny_lm(False)
    ids, attention, mask = batch()
    rows = []
    head = model.get_output_embeddings()
    handle = head.register_forward_hook(lambda m, a, out: rows.append(a[0].shape))
    lp, ent = token_logprobs(model, ids, attention, mask, TEMPERATURE, True, perf=chunks(1000))
    handle.remove()
    assert (lp[~mask] == 0).all() and (ent[~mask] == 0).all() and (lp[mask] < 0).all()
    # The model's own head ran on the last position only; the scored tokens went to
    # logprobs_from_hidden with the head's weight (no module call).
    assert rows == [torch.Size([3, 1, 16])]


def test_lora_on_the_head_takes_the_module_path_and_is_exact():
    cfg = LoRAConfig(enabled=True, r=2, alpha=4, target_modules=("q_proj", "lm_head"))
    model = add_adapters(tiny_lm(False), cfg, "CAUSAL_LM")
    for name, p in model.named_parameters():
        if "lora_B" in name:  # non-zero B: the adapter changes the logits
            torch.nn.init.normal_(p, 0.0, 0.1, generator=torch.Generator().manual_seed(3))
    grads = assert_same(model, 4)
    assert any("lm_head" in n and "lora_A" in n for n in grads)


def test_zero3_fetched_head_takes_the_module_path_and_is_exact(monkeypatch):
    # Under ZeRO-3's per-module fetching the head's weight is whole only inside its own
    # forward (zero3.stays_whole is False): the head is called per chunk, checkpointed.
    monkeypatch.setattr(engine_forward, "stays_whole", lambda p: False)
    calls = []
    model = tiny_lm(True)
    model.get_output_embeddings().register_forward_hook(lambda m, a, out: calls.append(1))
    assert_same(model, 4)
    assert len(calls) > 3  # the chunks, recomputed in backward


def test_adapter_off_reference_scores_the_base_head_too():
    base = tiny_lm(False)
    ids, attention, mask = batch()
    with torch.no_grad():
        expected, _ = whole_logits_path(base, ids, attention, mask)
    cfg = LoRAConfig(enabled=True, r=2, alpha=4, target_modules=("q_proj", "lm_head"))
    actor = add_adapters(base, cfg, "CAUSAL_LM")
    for name, p in actor.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, 0.0, 0.1, generator=torch.Generator().manual_seed(3))
    reference = AdapterOffReference(lambda: actor)
    lp, _ = token_logprobs(reference, ids, attention, mask, TEMPERATURE, perf=chunks(3))
    torch.testing.assert_close(lp, expected, atol=1e-6, rtol=1e-6)
    with torch.no_grad():
        adapted, _ = token_logprobs(actor, ids, attention, mask, TEMPERATURE, perf=chunks(3))
    assert (adapted - expected).abs().max() > 1e-3  # the adapters do change the actor


def test_actor_critic_forward_and_the_critic_only_pass():
    actor = tiny_lm(False)
    net = ActorCritic(actor, None)
    ids, attention, mask = batch()
    with torch.no_grad():
        lp, ent, values = net(ids, attention, mask, TEMPERATURE, True)
        expected_lp, expected_ent = whole_logits_path(actor, ids, attention, mask)
        assert net(ids, attention, mask, TEMPERATURE, True, with_actor=False) == (None,) * 3
    torch.testing.assert_close(lp, expected_lp, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent, expected_ent, atol=1e-6, rtol=1e-6)
    assert values is None


def test_the_configured_chunk_reaches_the_head(monkeypatch):
    model = tiny_lm(False)
    sizes = []
    model.get_output_embeddings().register_forward_hook(lambda m, a, o: sizes.append(a[0].shape))
    monkeypatch.setattr(engine_forward, "stays_whole", lambda p: False)  # head called per chunk
    ids, attention, mask = batch()
    with torch.no_grad():
        token_logprobs(model, ids, attention, mask, perf=chunks(3))
    # 11 scored tokens in chunks of 3 (after the model's own last-position call)
    assert [s[0] for s in sizes[1:]] == [3, 3, 3, 2]
