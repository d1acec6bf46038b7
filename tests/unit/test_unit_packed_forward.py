"""perf.packed_sequences (docs/architecture.md section 10): token_logprobs and ValueModel
on packed rows equal the padded forward in values and in every parameter's gradient (fp32,
tiny Llama, uneven rows with left and right padding), through eager and sdpa attention,
LoRA and gradient checkpointing; the backbone sees fewer, no wider rows."""

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

from rlhf_dist.config import LoRAConfig, PerfConfig
from rlhf_dist.engine import forward as engine_forward
from rlhf_dist.engine import packing as engine_packing
from rlhf_dist.engine.forward import token_logprobs
from rlhf_dist.errors import ConfigError
from rlhf_dist.models import ValueModel, enable_gradient_checkpointing
from rlhf_dist.models.lora import add_adapters

V, TEMPERATURE = 50, 0.7
PACKED = PerfConfig(logprob_chunk_tokens=4, packed_sequences=True)
PADDED = PerfConfig(logprob_chunk_tokens=4)


def tiny(kind, attn: str, seed: int = 0):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=32, max_position_embeddings=64,
        attention_dropout=0.0, pad_token_id=0, num_labels=1,
    )  # fmt: skip
    config._attn_implementation = attn
    return kind(config).eval()


def batch():
    """B = 4, L = 14: left-padded prompts (up to 8) then right-padded responses (up to 6);
    real lengths 13, 6, 5, 3, which first-fit decreasing packs into 2 rows of 14."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, V, (4, 14), generator=g)
    prompt = torch.tensor([8, 3, 2, 1])
    response = torch.tensor([5, 3, 3, 2])
    cols = torch.arange(8)
    attention = torch.cat(
        [(cols >= 8 - prompt[:, None]).long(), (torch.arange(6) < response[:, None]).long()], 1
    )
    return ids, attention, torch.arange(6) < response[:, None]


def backbone_widths(lm):
    """Record the (rows, width) of every backbone forward of transformers model `lm`."""
    shapes = []
    body = getattr(lm, lm.base_model_prefix)
    body.register_forward_pre_hook(
        lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    return shapes


def run(model, packed: bool, fn):
    model.zero_grad(set_to_none=True)
    outputs = fn(model, PACKED if packed else PADDED)
    g = torch.Generator().manual_seed(2)
    sum((o * torch.randn(o.shape, generator=g)).sum() for o in outputs).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return [o.detach() for o in outputs], grads


def assert_packed_equals_padded(model, lm, fn):
    shapes = backbone_widths(lm)
    padded, padded_grads = run(model, False, fn)
    packed, packed_grads = run(model, True, fn)
    assert shapes == [(4, 14), (2, 14)]  # 56 -> 28 token slots, rows no wider
    for a, b in zip(packed, padded):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert packed_grads.keys() == padded_grads.keys() and len(packed_grads) > 0
    for name in padded_grads:
        torch.testing.assert_close(
            packed_grads[name], padded_grads[name], atol=1e-5, rtol=1e-5, msg=name
        )
    return packed_grads


def logprobs_fn(model, perf):
    ids, attention, mask = batch()
    return token_logprobs(model, ids, attention, mask, TEMPERATURE, True, perf=perf)


def values_fn(classifier, perf):
    ids, attention, mask = batch()
    values = ValueModel(classifier, perf)(ids, attention)
    return (values * attention,)  # padding values are read nowhere (0 when packed)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_token_logprobs_packed_equal_padded(attn):
    lm = tiny(LlamaForCausalLM, attn)
    grads = assert_packed_equals_padded(lm, lm, logprobs_fn)
    assert "model.layers.0.self_attn.q_proj.weight" in grads


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_value_model_packed_equal_padded(attn):
    classifier = tiny(LlamaForSequenceClassification, attn)
    assert_packed_equals_padded(classifier, classifier, values_fn)
    model = ValueModel(classifier, PACKED)
    ids, attention, _ = batch()
    with torch.no_grad():
        assert bool((model(ids, attention)[attention == 0] == 0).all())
        with pytest.raises(ValueError, match="own position ids"):
            model(ids, attention, engine_packing.position_ids_from(attention))


def test_lora_and_gradient_checkpointing_packed_equal_padded():
    lm = tiny(LlamaForCausalLM, "sdpa")
    cfg = LoRAConfig(enabled=True, r=2, alpha=4, target_modules=("q_proj", "v_proj", "lm_head"))
    model = enable_gradient_checkpointing(add_adapters(lm, cfg, "CAUSAL_LM")).train()
    for name, p in model.named_parameters():
        if "lora_B" in name:  # non-zero B: the adapters change the outputs
            torch.nn.init.normal_(p, 0.0, 0.1, generator=torch.Generator().manual_seed(3))
    grads = assert_packed_equals_padded(model, engine_forward.causal_lm(model), logprobs_fn)
    assert any("lora_A" in n for n in grads) and not any("lora" not in n for n in grads)


def test_rows_with_a_gap_are_refused():
    lm = tiny(LlamaForCausalLM, "eager")
    ids, attention, mask = batch()
    attention[1, 9] = 0  # a hole inside row 1's response
    with pytest.raises(ValueError, match=r"contiguous; rows \[1\]"):
        token_logprobs(lm, ids, attention, mask, perf=PACKED)


def test_backbones_without_masking_utils_are_refused():
    engine_packing.check_packable(tiny(LlamaForCausalLM, "sdpa"))  # Llama: accepted

    class OwnMasks(nn.Module):  # a backbone that builds its masks itself
        base_model_prefix = "body"

        def __init__(self):
            super().__init__()
            self.body = nn.Linear(2, 2)

    with pytest.raises(ConfigError, match="perf.packed_sequences: Linear does not build"):
        engine_packing.check_packable(OwnMasks())
    _, attention, _ = batch()
    with pytest.raises(ConfigError, match="perf.packed_sequences"):
        engine_packing.packing_layout(OwnMasks(), attention, packed=True)
    assert engine_packing.packing_layout(OwnMasks(), attention, packed=False) is None


def test_flash_attention_gets_every_sequence_in_one_row():
    # transformers runs flash attention's varlen kernels from position ids only in a batch
    # of one (modeling_flash_attention_utils._is_packed_sequence): one row, no padding.
    lm = tiny(LlamaForCausalLM, "sdpa")
    _, attention, _ = batch()
    gather, _, position_ids = engine_packing.packing_layout(lm, attention, packed=True)
    assert gather.shape == (2, 14)  # bins of the padded width for the masked kernels
    lm.config._attn_implementation = "flash_attention_2"  # the layout only: no forward here
    gather, _, position_ids = engine_packing.packing_layout(lm, attention, packed=True)
    assert gather.shape == (1, 27) and bool((gather >= 0).all())
    assert int((position_ids == 0).sum()) == 4  # one start per sequence
