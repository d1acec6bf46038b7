"""The memory planner on mixture-of-experts shapes (docs/moe.md): total and active
parameters by hand and on the shipped Qwen3-30B-A3B shape, the sparse layers of each
family's config names, the router's kept logits, and `rlhf-dist plan` on 8 x 80 GB."""

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from rlhf_dist.config import load_config
from rlhf_dist.planning import Hardware, ModelShape, Shapes, build_plan
from rlhf_dist.planning import memory as mem
from rlhf_dist.planning.shapes import expert_numbers, read_shape

ROOT = Path(__file__).resolve().parents[2]
QWEN3_MOE = ROOT / "launch/configs/shapes/qwen3-30b-a3b"
# 2 layers, the second sparse: router 4x3, 3 experts of width 2 (3 x 4 x 2 = 24 each),
# top-1, a shared expert of width 1 (12)
TINY_MOE = ModelShape(
    vocab=10, hidden=4, layers=2, heads=2, kv_heads=1, head_dim=2, intermediate=8,
    experts=3, experts_per_token=1, expert_intermediate=2, shared_intermediate=1, moe_layers=1,
)  # fmt: skip


def test_moe_tiny_shape_by_hand():
    # attention 16 + 8 + 8 + 16 = 48; dense MLP 96; sparse block 12 + 3 x 24 + 12 = 96
    assert TINY_MOE.attention_params() == 48
    assert TINY_MOE.sparse_block_params() == 96
    assert TINY_MOE.all_linear_params() == 2 * 48 + 96 + 96
    # + 2 norms of 4 per layer; embedding 40, final norm 4, head 40
    assert TINY_MOE.lm_params() == 40 + (288 + 2 * 8) + 4 + 40
    # a token runs 1 of the 3 experts: 2 x 24 never computed for it
    assert TINY_MOE.active_params() == TINY_MOE.lm_params() - 48
    # the router's (n, E) logits in bf16 and their fp32 softmax, one MoE layer: 5 x 3 x 6
    assert mem.router_logits_kept(TINY_MOE, 5, 2.0) == 5 * 1 * 3 * (2.0 + 4.0)


def test_moe_qwen3_30b_a3b_total_and_active_parameters():
    shape = read_shape(str(QWEN3_MOE), "model.policy")
    assert (shape.experts, shape.experts_per_token, shape.moe_layers) == (128, 8, 48)
    # 48 x (attention 18,874,368 + router 262,144 + 128 x 4,718,592) + 2 x 311,164,928
    # embedding and head + norms: 30.53B (published: 30.5B total, 3.3B active)
    assert shape.lm_params() == 30_532_110_336
    assert shape.active_params() == 30_532_110_336 - 48 * 120 * 4_718_592


def test_moe_sparse_layers_of_each_family():
    dense = SimpleNamespace(num_hidden_layers=4)
    assert expert_numbers(dense, 64) == {}
    deepseek = SimpleNamespace(  # DeepSeek-V3 style: 3 dense layers first, 1 shared expert
        num_hidden_layers=6, n_routed_experts=16, num_experts_per_tok=4,
        moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=3,
    )  # fmt: skip
    assert expert_numbers(deepseek, 128) == {
        "experts": 16, "experts_per_token": 4, "expert_intermediate": 32,
        "shared_intermediate": 32, "moe_layers": 3,
    }  # fmt: skip
    mixtral = SimpleNamespace(num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2)
    assert expert_numbers(mixtral, 64)["expert_intermediate"] == 64  # the dense width
    qwen2 = SimpleNamespace(  # every 2nd layer sparse, layer 3 dense by name
        num_hidden_layers=6, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
        shared_expert_intermediate_size=16, decoder_sparse_step=2, mlp_only_layers=[3],
    )  # fmt: skip
    numbers = expert_numbers(qwen2, 64)
    assert numbers["moe_layers"] == 2 and numbers["shared_intermediate"] == 16  # layers 1, 5


def test_moe_activations_count_the_routed_experts_not_the_dense_width():
    # checkpointing off: a MoE layer keeps k x (4 f_e + 2h) + 4 f_s + 2E for its MLP
    # instead of 4f; dense 4f = 32, sparse 1 x (8 + 8) + 4 + 6 = 26
    dense = mem.layer_activation_elements(TINY_MOE, 3, "sdpa")
    assert mem.sparse_layer_elements(TINY_MOE, 3, "sdpa") == dense - 32 + 26
    kept = mem.kept_activations(TINY_MOE, 1, 3, 1.0, "sdpa", False)
    assert kept == 3 * (dense + (dense - 6) + 4 * 4)


def test_moe_plan_of_qwen3_30b_a3b_on_8_gpus():
    cfg = load_config(None, [f"model.policy={QWEN3_MOE}", "data.train=x"], "grpo")
    plan = build_plan(
        cfg, "ppo", Shapes(read_shape(str(QWEN3_MOE), "model.policy")), Hardware(8, 80 * 2**30, 3)
    )
    update = dict(next(p for p in plan.phases if p.name == "update").terms)
    assert update["router logits (MoE balance loss)"] > 0
    # one sparse block (all 128 experts of a layer) fetched as one ZeRO-3 leaf
    assert update["fetched weights (ZeRO-3)"] >= 128 * 4_718_592 * 2
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "rlhf_dist", "plan", "--preset", "grpo", "--gpus", "8",
         "--gpu-memory", "80GB", f"model.policy={QWEN3_MOE}", "perf.gather_for_generation=false"],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "30.5B parameters, 3.4B active per token (128 experts, top-8)" in proc.stdout
    assert time.monotonic() - start < 60  # seconds, not a model load
