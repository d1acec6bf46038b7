"""The planner's term for an update forward that runs each distinct prompt once
(planning/memory.py shared_prompt_activations, perf.shared_prompt_forward) against what
autograd keeps: on a tiny Llama, the bytes saved for backward by
engine.forward.final_hidden_states over 4 rows sharing one long prompt (32 prompt + 4
response tokens), counted through saved-tensor hooks (one count per storage, parameters
left out), with 1 and 3 layers. The per-layer difference isolates what each layer keeps;
at these lengths the responses' cached keys and values are a quarter of it, so a term
that left them out (or counted every row's prompt) would miss by more than the bound."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlhf_dist.config import PerfConfig
from rlhf_dist.engine.forward import final_hidden_states
from rlhf_dist.planning import ModelShape
from rlhf_dist.planning import memory as mem

ROWS, PROMPT, RESPONSE = 4, 32, 4


def saved_elements(layers: int, shared: bool) -> int:
    """fp32 elements autograd keeps in the backbone's forward of ROWS rows of one prompt."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=layers, attn_implementation="sdpa",
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    prompt = torch.randint(3, 64, (1, PROMPT)).expand(ROWS, PROMPT)
    ids = torch.cat([prompt, torch.randint(3, 64, (ROWS, RESPONSE))], 1)
    perf = PerfConfig(shared_prompt_forward=shared, packed_sequences=False)
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        final_hidden_states(model, model, ids, torch.ones_like(ids), PROMPT, perf)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in weights) // 4


def planned(layers: int) -> float:
    shape = ModelShape(
        vocab=64, hidden=32, layers=layers, heads=4, kv_heads=2, head_dim=8, intermediate=48
    )
    return mem.shared_prompt_activations(shape, ROWS, 1, PROMPT, RESPONSE, 1.0, "fused")


def test_shared_prompt_term_matches_what_autograd_keeps():
    kept = {layers: saved_elements(layers, shared=True) for layers in (1, 3)}
    plan = {layers: planned(layers) for layers in (1, 3)}
    per_layer = (plan[3] - plan[1]) / (kept[3] - kept[1])
    # seen 1.06 per layer: Korthikanti's count keeps a little more than autograd does
    assert 0.95 <= per_layer <= 1.10, (plan, kept)
    assert 0.95 <= plan[3] / kept[3] <= 1.10, (plan, kept)
    # the prompt once, not once per row: well under the whole rows' forward
    assert kept[3] < 0.6 * saved_elements(3, shared=False)
