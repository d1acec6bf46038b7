"""perf.shared_prompt_forward (algo/prefix.py, docs/architecture.md section 10): rollout
forwards that run each distinct prompt once equal the whole-row forward in log-probs,
entropies and every parameter's gradient (fp32 tiny Llama with grouped KV heads,
left-padded prompts of different lengths, right-padded responses), through eager and sdpa
attention and LoRA; the backbone sees the distinct prompts, then the responses; the
prefill of generation likewise, with the same logits."""

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlhf_dist.config import LoRAConfig, PerfConfig
from rlhf_dist.engine import forward as engine_forward
from rlhf_dist.engine.decode import generate
from rlhf_dist.engine.forward import token_logprobs
from rlhf_dist.models import ActorCritic, enable_gradient_checkpointing
from rlhf_dist.models.lora import add_adapters

V, TEMPERATURE, P, T = 50, 0.7, 6, 5


def tiny(attn: str = "sdpa", seed: int = 0):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=32, max_position_embeddings=64,
        attention_dropout=0.0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    config._attn_implementation = attn
    return LlamaForCausalLM(config).eval()


def rollout_batch(groups: int = 3, n: int = 3):
    """B = groups * n rows: prompt g (left-padded to P, real length 6 - 2g) n times in a
    row, then right-padded responses of lengths 5, 4, 3, 2, ... (at least 1)."""
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(2, V, (groups, P), generator=g).repeat_interleave(n, 0)
    lengths = (P - 2 * torch.arange(groups)).clamp(min=1).repeat_interleave(n)
    prompt_mask = (torch.arange(P) >= P - lengths[:, None]).long()
    prompts = prompts.masked_fill(prompt_mask == 0, 0)
    responses = torch.randint(2, V, (groups * n, T), generator=g)
    response_mask = torch.arange(T) < (T - torch.arange(groups * n) % T).clamp(min=1)[:, None]
    ids = torch.cat([prompts, responses.masked_fill(~response_mask, 0)], 1)
    return ids, torch.cat([prompt_mask, response_mask.long()], 1), response_mask


def backbone_shapes(lm):
    shapes = []
    body = getattr(lm, lm.base_model_prefix)
    body.register_forward_pre_hook(
        lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    return shapes


SHARED = PerfConfig(logprob_chunk_tokens=4)  # shared_prompt_forward on by default
WHOLE = PerfConfig(logprob_chunk_tokens=4, shared_prompt_forward=False)


def logprobs_and_grads(model, lm, shared: bool, batch=None):
    ids, attention, mask = batch or rollout_batch()
    model.zero_grad(set_to_none=True)
    perf = SHARED if shared else WHOLE
    lp, ent = token_logprobs(model, ids, attention, mask, TEMPERATURE, True, P, perf)
    g = torch.Generator().manual_seed(2)
    ((lp * torch.randn(lp.shape, generator=g)).sum() + ent.sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp.detach(), ent.detach(), grads


def assert_same(a, b):
    for x, y in zip(a[:2], b[:2]):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5)
    assert a[2].keys() == b[2].keys() and len(a[2]) > 0
    for name in a[2]:
        torch.testing.assert_close(a[2][name], b[2][name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_shared_prompt_logprobs_and_gradients_equal_whole_rows(attn):
    lm = tiny(attn)
    shapes = backbone_shapes(lm)
    whole = logprobs_and_grads(lm, lm, False)
    shared = logprobs_and_grads(lm, lm, True)
    assert shapes == [(9, P + T), (3, P), (9, T)]  # 3 distinct prompts of 9 rows
    assert_same(shared, whole)
    assert "model.layers.0.self_attn.k_proj.weight" in shared[2]


def test_lora_shared_prompt_equals_whole_rows():
    lm = tiny()
    cfg = LoRAConfig(enabled=True, r=2, alpha=4, target_modules=("q_proj", "v_proj", "lm_head"))
    model = add_adapters(lm, cfg, "CAUSAL_LM").train()
    for name, p in model.named_parameters():
        if "lora_B" in name:  # non-zero B: the adapters change the outputs
            torch.nn.init.normal_(p, 0.0, 0.1, generator=torch.Generator().manual_seed(3))
    inner = engine_forward.causal_lm(model)
    shared = logprobs_and_grads(model, inner, True)
    assert_same(shared, logprobs_and_grads(model, inner, False))
    assert any("lora_A" in n for n in shared[2])


def test_two_forwards_whatever_the_data_and_one_under_checkpointing():
    # Distinct prompts only (n = 1): still two forwards, so ZeRO-3 ranks whose prompts
    # repeat and ranks whose prompts do not run the same number of forwards.
    lm = tiny()
    shapes = backbone_shapes(lm)
    batch = rollout_batch(groups=3, n=1)
    assert_same(logprobs_and_grads(lm, lm, True, batch), logprobs_and_grads(lm, lm, False, batch))
    assert shapes == [(3, P), (3, T), (3, P + T)]
    # Gradient checkpointing has no KV cache in training: the whole rows, one forward.
    enable_gradient_checkpointing(lm).train()
    shapes.clear()
    logprobs_and_grads(lm, lm, True)
    assert shapes == [(9, P + T)]
    assert not engine_forward.shares_prompts(lm, SHARED)


def test_actor_critic_passes_the_prompt_width():
    lm = tiny()
    shapes = backbone_shapes(lm)
    ids, attention, mask = rollout_batch()
    with torch.no_grad():
        ActorCritic(lm, None, SHARED)(ids, attention, mask, TEMPERATURE, with_entropy=True)
    assert shapes == [(3, P), (9, T)]
    shapes.clear()  # PPO-ptx's SFT rows are no prompt + response: whole rows, one forward
    with torch.no_grad():
        ActorCritic(lm, None, SHARED)(ids, attention, mask, with_critic=False, share_prompts=False)
    assert shapes == [(9, P + T)]
    shapes.clear()  # the switch off: whole rows
    with torch.no_grad():
        ActorCritic(lm, None, WHOLE)(ids, attention, mask, TEMPERATURE)
    assert shapes == [(9, P + T)]


def test_generation_prefill_runs_each_prompt_once_with_the_same_logits(monkeypatch):
    """The prefill of 3 distinct prompts indexed out to 9 rows gives every decode step
    the logits of the 9-row prefill, to fp32 rounding (other row counts can take other
    kernels); tokens are forced (spies.forced_decode), so both paths decode the same ones."""
    from spies import forced_decode

    import rlhf_dist.engine.decode as rollout

    lm = tiny()
    shapes = backbone_shapes(lm)
    ids, attention, _ = rollout_batch()
    prompt_ids, prompt_mask = ids[:, :P], attention[:, :P]
    tok = SimpleNamespace(pad_token_id=0, eos_token_id=1)
    gen = SimpleNamespace(max_new_tokens=6, min_new_tokens=0, temperature=1.0, top_k=0, top_p=1.0)
    seen = forced_decode(monkeypatch, rollout, vocab=V)
    logits = {}
    for shared in (False, True):
        shapes.clear()
        seen.clear()
        generate(lm, prompt_ids, prompt_mask, gen, tok, perf=SHARED if shared else WHOLE)
        logits[shared] = list(seen)
        assert shapes[0] == ((3, P) if shared else (9, P))
        assert all(s == (9, 1) for s in shapes[1:])
    assert len(logits[True]) == len(logits[False]) == 6
    for a, b in zip(logits[True], logits[False]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_no_sharing_with_gradients_under_zero3_partitioned_weights():
    lm = tiny()
    for i, p in enumerate(lm.parameters()):
        p.ds_id = i  # what DeepSpeed ZeRO-3 marks its partitioned parameters with
    assert not engine_forward.shares_prompts(lm, SHARED)  # grad: one forward, whole rows
    with torch.no_grad():
        assert engine_forward.shares_prompts(lm, SHARED)  # scoring and generation share
        assert not engine_forward.shares_prompts(lm, WHOLE)


def test_no_sharing_for_a_vision_language_model():
    """Decided by the model, not by whether a batch holds images: under ZeRO-3 a rank whose
    rows hold none must run as many forwards as one whose rows do."""
    lm = tiny()
    with torch.no_grad():
        assert engine_forward.shares_prompts(lm, SHARED)
        lm.config.vision_config = SimpleNamespace()  # what marks a vision-language config
        assert not engine_forward.shares_prompts(lm, SHARED)
