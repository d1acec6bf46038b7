"""The planner's LoRA activation term against what autograd keeps (planning/memory.py
kept_activations): on a tiny Llama, the bytes saved for backward by the decoder's
forward, counted through saved-tensor hooks (one count per storage, parameters left
out), without and with LoRA on every linear. The plan's difference between the two must
be the measured difference: the adapters' (n, r) intermediates added, the frozen norms'
normalised inputs and the first layer's input no longer kept."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlhf_dist.config import load_config
from rlhf_dist.models.lora import add_adapters
from rlhf_dist.planning import ModelShape
from rlhf_dist.planning import memory as mem

CONFIG = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4,
    num_key_value_heads=2, attn_implementation="sdpa",
)  # fmt: skip


def saved_elements(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """fp32 elements of the tensors autograd keeps for backward in the decoder's forward."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model(input_ids=ids)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in weights) // 4


@pytest.mark.parametrize("layers", [1, 3])
def test_lora_activation_term_matches_what_autograd_keeps(layers):
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=layers, **CONFIG)
    ids = torch.randint(0, 64, (2, 12))
    rank = 4
    full = saved_elements(LlamaForCausalLM(config), ids)
    lora_cfg = load_config(None, ["lora.enabled=true", f"lora.r={rank}"]).lora
    adapted = add_adapters(LlamaForCausalLM(config), lora_cfg, "CAUSAL_LM")
    lora = saved_elements(adapted.base_model.model, ids)
    shape = ModelShape(
        vocab=64, hidden=32, layers=layers, heads=4, kv_heads=2, head_dim=8, intermediate=48
    )
    planned = [mem.kept_activations(shape, 2, 12, 1.0, "fused", False, r) for r in (0, rank)]
    # per token, the plan and autograd agree on the difference but for a few scalars (the
    # norms' 1 / rms, which the plan leaves out)
    assert abs((planned[0] - planned[1]) - (full - lora)) <= 24 * 4, (planned, full, lora)
    assert lora < full  # at this rank the frozen norms save more than the adapters cost
