"""The memory plan of a mixture-of-experts model against its measured peak, as
test_integration_plan_measured.py does for a Llama: a random tiny Qwen3-MoE (8 fused
experts of width 64, top-2, in place of a dense MLP of width 176), 8 sequences of 16 + 16
tokens, each phase's planned peak within 15% of the tensors' measured peak (seen: 0.93
to 0.99 of it). The update's activations are counted by the k experts each token runs,
not the dense width (planning/memory.py sparse_layer_elements)."""

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "launch/bench"


def test_moe_plan_is_within_15_percent_of_the_measured_peak(tmp_path, monkeypatch):
    from transformers import Qwen3MoeConfig

    monkeypatch.syspath_prepend(str(BENCH))
    import memory as plan_check

    h, layers, heads, kv, dense, vocab = 64, 2, 4, 2, 176, 2048
    monkeypatch.setitem(plan_check.SIZES, "MOE", (h, layers, heads, kv, dense, vocab))
    Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, head_dim=h // heads, intermediate_size=dense,
        moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=1024, tie_word_embeddings=False, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, router_aux_loss_coef=0.0, attn_implementation="sdpa",
    ).save_pretrained(str(tmp_path / "MOE"))  # fmt: skip
    plan = plan_check.planned(tmp_path / "MOE", 16, 16, "plain", "sdpa")
    measured = plan_check.measure(tmp_path / "MOE", 16, 16, "plain")
    for phase in plan_check.PHASES:
        assert plan[phase] == pytest.approx(measured[phase], rel=0.15), phase
    sys.modules.pop("memory", None)
