"""QLoRA (lora.load_in_4bit, docs/distributed.md): a clear error where bitsandbytes cannot
run, and where it can (its CPU backend, bitsandbytes 0.50.2 here, installed by
launch/setup.sh) a LoRA PPO run on an NF4 base: the adapters train, the 4-bit base stays
as loaded, and the merged export is the dequantized base plus the trained adapters."""

from __future__ import annotations

import pytest
import torch
from spies import capture_calls

from rlhf_dist.config import ConfigError, config_from_dict, load_config, validate
from rlhf_dist.config import validation as config_module
from rlhf_dist.trainers import ppo
from rlhf_dist.trainers.ppo import setup as ppo_setup


def test_4bit_without_bitsandbytes_is_one_config_error(monkeypatch):
    monkeypatch.setattr(config_module, "_installed", lambda name: name != "bitsandbytes")
    cfg = load_config(
        None, ["model.policy=p", "data.train=t", "lora.enabled=true", "lora.load_in_4bit=true"]
    )
    with pytest.raises(ConfigError, match=r"lora\.load_in_4bit: needs the bitsandbytes package"):
        validate(cfg, "dpo")


def test_4bit_needs_lora():
    cfg = load_config(None, ["model.policy=p", "data.train=t", "lora.load_in_4bit=true"])
    with pytest.raises(ConfigError, match=r"lora\.load_in_4bit: needs lora\.enabled"):
        validate(cfg, "dpo")


def test_qlora_ppo_trains_the_adapters_and_exports_dequantized_base_plus_adapters(
    task_env, runtime, tmp_path, monkeypatch, data_cfg, read_jsonl
):
    pytest.importorskip("bitsandbytes", reason="QLoRA runs where bitsandbytes is installed")
    from bitsandbytes.functional import dequantize_4bit
    from bitsandbytes.nn import Linear4bit
    from transformers import AutoModelForCausalLM

    from rlhf_dist.models.lora import nf4_round_trip

    built = capture_calls(monkeypatch, ppo_setup, "build_models")
    out = tmp_path / "run"
    tree = {
        "run": {"output_dir": str(out), "seed": 0, "log_every": 1},
        "model": {"policy": str(task_env.policy)},
        "data": data_cfg(train=str(task_env.prompts), max_length=40),
        "generation": {"max_new_tokens": 6},
        "reward": {"function": "rlhf_dist.demo.task:positive_word_reward"},
        "ppo": {
            "critic_init": "policy", "iterations": 2, "rollout_batch_size": 8,
            "rollout_micro_batch_size": 8, "minibatch_size": 4, "micro_batch_size": 4,
            "ppo_epochs": 1, "optim": {"lr": 1e-2},
        },
        "lora": {
            "enabled": True, "load_in_4bit": True, "r": 4,
            "target_modules": ["q_proj", "v_proj"], "export": "merged",
        },
    }  # fmt: skip
    cfg = config_from_dict(tree)
    validate(cfg, "ppo")
    ppo.train_ppo(cfg, runtime)

    # The adapters got gradients in every step (after each rollout's eval-mode forwards:
    # lora.keep_4bit_differentiable) ...
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["optim/grad_norm_actor"] > 0 for r in rows)
    # ... and the frozen 4-bit base is still the NF4 round trip of the policy.
    base = nf4_round_trip(AutoModelForCausalLM.from_pretrained(task_env.policy))
    ((_, _, models),) = built
    actor = runtime.unwrap(models.model).actor.get_base_model()
    quantized = {n: m for n, m in actor.named_modules() if isinstance(m, Linear4bit)}
    assert len(quantized) == 14  # 2 layers x (q, k, v, o, gate, up, down)
    for name, layer in quantized.items():
        weight = dequantize_4bit(layer.weight.data, layer.weight.quant_state)
        want = base.get_submodule(name.removesuffix(".base_layer")).weight
        assert torch.equal(weight.to(want.dtype).reshape(want.shape), want), name
    assert torch.equal(actor.lm_head.weight, base.lm_head.weight)  # not quantized, frozen

    merged = AutoModelForCausalLM.from_pretrained(out / "final")
    assert getattr(merged.config, "quantization_config", None) is None
    layer, ref = merged.model.layers[0], base.model.layers[0]
    # not adapted: exactly the NF4 base, dequantized; adapted: that plus a trained delta
    assert torch.equal(layer.mlp.gate_proj.weight, ref.mlp.gate_proj.weight)
    assert not torch.equal(layer.self_attn.q_proj.weight, ref.self_attn.q_proj.weight)
    plain = AutoModelForCausalLM.from_pretrained(task_env.policy).model.layers[0]
    assert not torch.equal(ref.mlp.gate_proj.weight, plain.mlp.gate_proj.weight)  # quantized
