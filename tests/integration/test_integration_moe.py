"""Mixture-of-experts policies (docs/moe.md): tiny Qwen3-MoE, Mixtral and OLMoE built from
their transformers 5 configs (experts fused into 3-D parameters) train by SFT, DPO and
GRPO (Qwen3-MoE also KTO) with the routers' load-balancing loss (`loss/router_aux`): trained weights change,
frozen ones do not. The loss's expert fractions are counted over the whole batch, so the
gradient of an SFT step does not depend on its micro-batch split."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from moe_models import FAMILIES, tiny_moe
from spies import capture_calls

from rlhf_dist.config import PerfConfig, config_from_dict
from rlhf_dist.data.batching import BatchPlan
from rlhf_dist.data.rows import load_rows, sft_examples
from rlhf_dist.models import enable_gradient_checkpointing, load_causal_lm
from rlhf_dist.models.moe import router_aux
from rlhf_dist.trainers import ppo
from rlhf_dist.trainers.dpo import train_dpo
from rlhf_dist.trainers.kto import train_kto
from rlhf_dist.trainers.ppo import setup as ppo_setup
from rlhf_dist.trainers.sft import sft_step, train_sft


@pytest.fixture(scope="module")
def moe_policies(task_env, tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {f: tiny_moe(f, task_env.tokenizer, root) for f in FAMILIES}


def stage_tree(stage, out, policy, task_env, data_cfg) -> dict:
    run = {"output_dir": str(out), "seed": 0, "log_every": 1}
    model = {"policy": policy}
    if stage == "sft":
        section = {"epochs": 1, "batch_size": 8, "micro_batch_size": 4, "optim": {"lr": 3e-3}}
        return {"run": run, "model": model, "data": data_cfg(train=str(task_env.files.sft)),
                "sft": section, "_limit": 16}  # fmt: skip
    if stage in ("dpo", "kto"):
        section = {"epochs": 1, "batch_size": 8, "micro_batch_size": 4, "optim": {"lr": 3e-3}}
        return {"run": run, "model": model, "data": data_cfg(train=str(task_env.files.prefs_train)),
                stage: section, "_limit": 16}  # fmt: skip
    return {
        "run": run, "model": model, "data": data_cfg(train=str(task_env.files.prompts)),
        "generation": {"max_new_tokens": 8},
        "reward": {"function": "rlhf_dist.demo.task:positive_word_reward"},
        "ppo": {"estimator": "grpo", "iterations": 1, "rollout_batch_size": 4,
                "samples_per_prompt": 2, "rollout_micro_batch_size": 8, "minibatch_size": 8,
                "micro_batch_size": 4, "ppo_epochs": 1, "optim": {"lr": 3e-3}},
    }  # fmt: skip


@pytest.mark.parametrize(
    ("family", "stage"),
    [(f, s) for f in FAMILIES for s in ("sft", "dpo", "grpo")] + [("qwen3_moe", "kto")],
)
def test_moe_families_train_with_the_load_balancing_loss(
    family, stage, moe_policies, task_env, runtime, tmp_path, monkeypatch, data_cfg,
    saved_state_dict, changed_tensors, read_jsonl,
):  # fmt: skip
    policy, out = moe_policies[family], tmp_path / stage
    tree = stage_tree(stage, out, policy, task_env, data_cfg)
    limit = tree.pop("_limit", None)
    if limit:  # a few steps: the first rows of the task file only
        src = tmp_path / "rows.jsonl"
        lines = Path(tree["data"]["train"]).read_text().splitlines(keepends=True)
        src.write_text("".join(lines[:limit]))
        tree["data"]["train"] = str(src)
    built = capture_calls(monkeypatch, ppo_setup, "build_models")
    if stage == "sft":
        train_sft(config_from_dict(tree), runtime)
    elif stage == "dpo":
        train_dpo(config_from_dict(tree), runtime)
    elif stage == "kto":
        train_kto(config_from_dict(tree), runtime)
    else:
        ppo.train_ppo(config_from_dict(tree), runtime)
    initial, final = saved_state_dict(policy), saved_state_dict(out / "final")
    changed = changed_tensors(initial, final)
    # every expert tensor, router and attention weight moved
    assert all(k in changed for k in initial if "experts" in k or ".gate." in k), changed
    rows = read_jsonl(out / "metrics.jsonl")
    aux = [r["loss/router_aux"] for r in rows]
    # 2 layers of 4 experts at top-2: k = 2 when balanced, up to E * k / ... when not
    assert all(math.isfinite(a) and 1.0 < a < 8.0 for a in aux), aux
    if stage == "grpo":  # the reference is frozen
        ((_, _, models),) = built
        reference = models.reference.state_dict()
        assert changed_tensors(initial, reference) == []


def test_moe_sft_gradient_with_the_load_balancing_loss_does_not_depend_on_the_split(
    moe_policies, task_env, runtime, data_cfg
):
    rows = load_rows(str(task_env.files.sft), "data.train")[100:108]
    data = config_from_dict({"data": data_cfg()}).data
    examples, _ = sft_examples(rows, task_env.tokenizer, data)
    pad = task_env.tokenizer.pad_token_id
    base = load_causal_lm(moe_policies["qwen3_moe"], "model.policy")
    aux = router_aux(0.5, base)  # a large weight: the term is a visible share of the gradient

    def grads(plan, coef=0.5, checkpointing=False):
        model = copy.deepcopy(base)
        if checkpointing:  # layers recomputed in backward: the recorded logits still serve
            enable_gradient_checkpointing(model).train()
        term = None if coef == 0 else router_aux(coef, model)
        metrics, _ = sft_step(runtime, model, examples, plan, pad, PerfConfig(), term)
        return {n: p.grad.clone() for n, p in model.named_parameters()}, metrics

    assert aux is not None and aux.top_k == 2 and len(aux.routers) == 2
    whole, m_whole = grads(BatchPlan(8, 1, 8))
    split, m_split = grads(BatchPlan(8, 1, 2))
    assert m_split["loss/router_aux"] == pytest.approx(m_whole["loss/router_aux"], rel=1e-6)
    recomputed, _ = grads(BatchPlan(8, 1, 2), checkpointing=True)
    for name in whole:
        assert (split[name] - whole[name]).norm() <= 1e-5 * whole[name].norm(), name
        assert (recomputed[name] - whole[name]).norm() <= 1e-5 * whole[name].norm(), name
    # the routers' gradient is the load-balancing term's as well: without it, it differs
    plain, _ = grads(BatchPlan(8, 1, 8), coef=0)
    router = "model.layers.0.mlp.gate.weight"
    assert (plain[router] - whole[router]).norm() > 1e-3 * whole[router].norm()


@pytest.mark.parametrize("experts", [False, True])
def test_moe_lora_grpo_trains_only_its_adapters(
    experts, moe_policies, task_env, runtime, tmp_path, monkeypatch, data_cfg, saved_state_dict
):
    """lora.experts false: adapters on attention only; true: on the fused experts too
    (peft target_parameters). Only adapters change; the base, its experts and routers
    stay as loaded."""
    policy, out = moe_policies["qwen3_moe"], tmp_path / "grpo"
    tree = stage_tree("grpo", out, policy, task_env, data_cfg)
    tree["lora"] = {"enabled": True, "r": 2, "experts": experts}
    built = capture_calls(monkeypatch, ppo_setup, "build_models")
    ppo.train_ppo(config_from_dict(tree), runtime)
    ((_, _, models),) = built
    actor = runtime.unwrap(models.model).actor
    adapters = {n: p for n, p in actor.named_parameters() if "lora_B" in n}
    assert adapters and all(p.abs().sum() > 0 for p in adapters.values())  # B started at 0
    assert any("experts" in n for n in adapters) == experts
    initial = saved_state_dict(policy)
    base = actor.get_base_model()
    with torch.no_grad():
        for name, p in base.named_parameters():
            if "lora_" in name:
                continue
            plain = name.replace(".base_layer", "")
            assert torch.equal(p, initial[plain]), name
