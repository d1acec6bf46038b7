"""models/moe.py and the MoE parts of models/lora.py (docs/moe.md): mixture-of-experts
configs recognised, sparse blocks found in every supported family, a config with experts
and no block found refused in one line, model.moe_leaf_modules; LoRA on attention only
or on the experts too, and the adapter-only sync a rollout server folds in."""

import copy
import functools
from types import SimpleNamespace

import pytest
import torch
import transformers
from moe_models import ListMoEConfig, ListMoEForCausalLM

from rlhf_dist.config import LoRAConfig, ModelConfig
from rlhf_dist.errors import ConfigError
from rlhf_dist.models.lora import add_adapters, lora_targets
from rlhf_dist.models.moe import expert_shape, prepare_moe, router_aux, sparse_blocks

SMALL = dict(
    vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts_per_tok=2,
)  # fmt: skip
FAMILIES = {  # config class, its expert count key, sparse block and router classes
    "Qwen2MoeConfig": ({"num_experts": 4, "moe_intermediate_size": 16,
                        "shared_expert_intermediate_size": 16}, "Qwen2MoeSparseMoeBlock"),
    "Qwen3MoeConfig": ({"num_experts": 4, "moe_intermediate_size": 16}, "Qwen3MoeSparseMoeBlock"),
    "MixtralConfig": ({"num_local_experts": 4}, "MixtralSparseMoeBlock"),
    "OlmoeConfig": ({"num_experts": 4}, "OlmoeSparseMoeBlock"),
    "GptOssConfig": ({"num_local_experts": 4, "layer_types": ["full_attention"] * 2}, "GptOssMLP"),
    "DeepseekV3Config": ({"n_routed_experts": 4, "moe_intermediate_size": 16,
                          "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
                          "q_lora_rank": None, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
                          "qk_nope_head_dim": 8, "v_head_dim": 16, "head_dim": 8}, "DeepseekV3MoE"),
}  # fmt: skip


def tiny(name: str):
    extra, _ = FAMILIES[name]
    torch.manual_seed(0)
    config = getattr(transformers, name)(**(SMALL | extra))
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_moe_every_family_is_recognised_and_its_sparse_blocks_found(name):
    model = tiny(name)
    shape = expert_shape(model.config)
    assert shape is not None and shape.num_experts == 4 and shape.top_k == 2
    blocks = sparse_blocks(model)
    sparse_layers = 1 if name == "DeepseekV3Config" else 2  # DeepSeek: layer 0 dense
    assert [type(b).__name__ for b, _ in blocks] == [FAMILIES[name][1]] * sparse_layers
    # the router's output is its logits, alone or first: (N, E)
    ids = torch.randint(0, 64, (2, 5))
    with torch.no_grad(), router_aux(1.0, model).recording(with_grad=False) as records:
        model(input_ids=ids)
    assert [tuple(r.shape) for r in records] == [(10, 4)] * sparse_layers


def test_moe_dense_models_and_declared_leaf_classes():
    dense = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))
    assert expert_shape(dense.config) is None and sparse_blocks(dense) == []
    assert router_aux(None, dense) is None
    prepare_moe(dense, None, "model.policy")  # nothing to do, nothing said
    model = ListMoEForCausalLM(ListMoEConfig())
    assert router_aux(0.0, model) is None  # 0 turns the loss off
    assert router_aux(None, model).coef == 0.02  # null: the model config's value
    with pytest.raises(ConfigError, match=r"model.moe_leaf_modules: no module of class \['Nope'\]"):
        prepare_moe(model, ModelConfig(moe_leaf_modules=("Nope",)), "model.policy")
    prepare_moe(model, ModelConfig(moe_leaf_modules=("ListMoEBlock",)), "model.policy")


def test_moe_config_with_experts_but_no_block_found_is_refused_in_one_line():
    model = ListMoEForCausalLM(ListMoEConfig())
    model.moe.router = model.moe.gate  # neither `gate` nor a router we know: renamed away
    del model.moe.gate
    model.moe.experts_list = model.moe.experts
    del model.moe.experts
    with pytest.raises(ConfigError) as err:
        prepare_moe(model, None, "model.policy")
    assert "model.moe_leaf_modules" in str(err.value) and "\n" not in str(err.value)


def test_moe_unknown_family_is_said_with_the_key_to_set(capsys):
    prepare_moe(ListMoEForCausalLM(ListMoEConfig()), None, "model.policy")
    out = capsys.readouterr().out
    assert "'list_moe' is not one rlhf_dist knows" in out and "model.moe_leaf_modules" in out


def test_moe_lora_targets_attention_only_or_the_experts_too():
    model = tiny("Qwen3MoeConfig")
    modules, params = lora_targets(model, LoRAConfig(enabled=True))
    assert params == [] and all("self_attn" in m for m in modules) and len(modules) == 8
    modules, params = lora_targets(model, LoRAConfig(enabled=True, experts=True))
    assert params == [f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1)
                      for p in ("gate_up_proj", "down_proj")]  # fmt: skip
    listed = ListMoEForCausalLM(ListMoEConfig())  # module-list experts: their linears
    lora = LoRAConfig(enabled=True, target_modules=("up", "down"))
    with pytest.raises(ConfigError, match="lora.experts=true"):
        lora_targets(listed, lora)
    modules, _ = lora_targets(listed, LoRAConfig(enabled=True, target_modules=("up", "down"), experts=True))  # fmt: skip
    assert len(modules) == 8 and not any("gate" in m for m in modules)  # routers never


@pytest.mark.parametrize("experts", [False, True])
def test_moe_adapter_only_sync_is_folded_in_by_a_rollout_server(experts):
    """As tests/unit/test_unit_serve.py's dense case: the base once, then only A and B;
    the served model then computes what the peft actor computes, fused 3-D experts folded
    expert by expert (serving/policy.py lora_delta)."""
    from rlhf_dist.generation.server import sync_entries
    from rlhf_dist.serving.policy import ServedPolicy, TensorSpec

    base = tiny("Qwen3MoeConfig").eval()
    served = copy.deepcopy(base)
    actor = add_adapters(copy.deepcopy(base), LoRAConfig(enabled=True, r=2, experts=experts), "CAUSAL_LM").eval()  # fmt: skip
    trained = [n for n, p in actor.named_parameters() if p.requires_grad]
    assert any("experts" in n for n in trained) == experts
    assert not any(".gate." in n for n in trained)  # the routers are never adapted
    server = SimpleNamespace(params=dict(served.named_parameters()), bases={}, adapter_parts={})
    apply = functools.partial(ServedPolicy._apply, server)
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        for name, p in actor.named_parameters():
            if "lora_" in name:
                p.copy_(0.2 * torch.randn_like(p))
        entries = sync_entries(actor, with_base=False)
        assert all(role in ("A", "B") for (_, role, _), _ in entries)
        assert any("experts" in name for (name, _, _), _ in entries) == experts
        for (name, role, scale), t in entries:
            apply(TensorSpec(name, tuple(t.shape), "float32", role, scale), t.clone())
        torch.testing.assert_close(served(ids).logits, actor(ids).logits, atol=1e-5, rtol=0)


def test_moe_demo_policy_and_its_flag():
    from rlhf_dist.cli import main
    from rlhf_dist.demo.task import tiny_llama_config, tiny_moe_policy

    dense = tiny_llama_config(100, 0, 1, 2)
    policy = tiny_moe_policy(dense)
    shape = expert_shape(policy.config)
    assert (shape.num_experts, shape.top_k, shape.aux_coef) == (4, 2, 0.001)
    assert len(sparse_blocks(policy)) == dense.num_hidden_layers
    assert policy.config.moe_intermediate_size == dense.intermediate_size // 4
    # refused before anything runs
    assert main(["demo", "--moe", "--task", "tool_use", "--algorithm", "grpo"]) == 2
