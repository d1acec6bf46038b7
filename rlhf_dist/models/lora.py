"""LoRA (peft) for the actor and, optionally, the critic.

With adapters on the actor, the reference policy is the same base with adapters
disabled: the base weights are held once (the reason one-GPU 7B PPO fits at all). That
is exact only while the base is frozen and the adapters start at zero (B = 0, peft's
default), which `add_adapters` guarantees (TRL PR #4723 learned this the hard way).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlhf_dist.config import LoRAConfig
from rlhf_dist.errors import ConfigError
from rlhf_dist.models import sub_state_dict
from rlhf_dist.models.moe import sparse_blocks
from rlhf_dist.models.vision import is_vision_part, language_model_modules


def add_adapters(
    model: nn.Module, lora_cfg: LoRAConfig, task_type: str, trainable_head: str | None = None
) -> nn.Module:
    """Wrap `model` in a fresh peft LoRA model (dropout 0; B initialised to 0).

    task_type: "CAUSAL_LM" or "SEQ_CLS"; trainable_head: a module trained in full next
    to the adapters (the critic's value head).
    """
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if getattr(model, "is_loaded_in_4bit", False):  # QLoRA: norms and head in fp32, base frozen
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        keep_4bit_differentiable(model)
    modules, parameters = lora_targets(model, lora_cfg)
    config = LoraConfig(
        r=lora_cfg.r,
        lora_alpha=lora_cfg.alpha,
        lora_dropout=0.0,  # dropout makes old and new log-probs disagree at ratio 1
        target_modules=modules,
        target_parameters=parameters or None,
        task_type=task_type,
        modules_to_save=[trainable_head] if trainable_head else None,
    )
    return get_peft_model(model, config)


def lora_targets(model: nn.Module, lora_cfg: LoRAConfig) -> tuple[list[str], list[str]]:
    """(peft's target_modules, its target_parameters) of `model`: lora.target_modules by
    name for a dense model. For a mixture of experts (docs/moe.md) never the routers, and
    the experts only with lora.experts: module-list experts through their linears of
    those names, fused experts (3-D parameters, transformers 5) through each parameter
    (peft's target_parameters: one low-rank pair per expert); lora.experts false leaves
    the sparse blocks out (adapters on attention and any dense MLP)."""
    blocks = {id(b) for b, _ in sparse_blocks(model)}
    if not blocks:
        names = {name.split(".")[-1] for name, _ in model.named_modules()}
        missing = [t for t in lora_cfg.target_modules if t not in names]
        if missing:
            raise ConfigError(f"lora.target_modules: {missing} not found in {type(model).__name__}")
        return dense_targets(model, lora_cfg.target_modules), []
    named = dict(model.named_modules())
    block_names = [n for n, m in named.items() if id(m) in blocks]
    wanted = set(lora_cfg.target_modules)
    modules, parameters = [], []
    for name in named:
        if name.split(".")[-1] not in wanted:
            continue
        block = next((b for b in block_names if name.startswith(b + ".")), None)
        if block is None or (lora_cfg.experts and name.startswith(f"{block}.experts.")):
            modules.append(name)
    for block in block_names if lora_cfg.experts else ():
        experts = named[f"{block}.experts"]
        fused = [n for n, p in experts.named_parameters(recurse=False) if p.ndim == 3]
        parameters += [f"{block}.experts.{n}" for n in fused]
    if not modules and not parameters:
        raise ConfigError(
            f"lora.target_modules: none of {sorted(wanted)} is outside the experts of "
            f"{type(model).__name__}; name its attention's linears, or set lora.experts=true"
        )
    return modules, parameters


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Run `model` as its frozen base (the reference policy / frozen reward model)."""
    with model.disable_adapter():
        yield model


@contextlib.contextmanager
def merged_adapters(model: nn.Module) -> Iterator[nn.Module]:
    """Run a peft LoRA `model` with its adapters folded into the base weights.

    Inside, every LoRA layer's base weight is W + scale * B @ A (computed in fp32, stored in
    the base's dtype) and the adapter path is off, so a forward costs what the plain model
    costs: generation, one forward per token, does not pay the four extra small kernels
    per adapted layer (x @ A, @ B, scale, add) that make it launch-bound on a GPU. The
    original base tensors are kept and put back on exit, bitwise: nothing is merged and
    "unmerged" by subtraction (which drifts in bf16 and would move the adapters-off
    reference policy). Costs one extra copy of the adapted weights while inside.
    Not for ZeRO-3-partitioned modules (their weights are not whole tensors here).
    """
    from peft.tuners.lora import LoraLayer

    if any(is_4bit(m) for m in model.modules()):  # QLoRA: no whole weights to fold into
        yield model
        return
    originals: list[tuple[nn.Module, str, nn.Parameter]] = []
    try:
        with torch.no_grad():
            for layer in model.modules():
                if not isinstance(layer, LoraLayer):
                    continue
                active = [a for a in layer.active_adapters if a in layer.lora_A]
                if not active:
                    continue
                base = layer.get_base_layer()
                # peft's ParamWrapper (fused experts, lora.experts) adapts one named
                # parameter of its base, (E, out, in): its delta has that shape
                attr = getattr(layer, "parameter_name", "weight")
                weight = getattr(base, attr)
                delta = sum(layer.get_delta_weight(a).float() for a in active)
                originals.append((base, attr, weight))
                merged = (weight.float() + delta).to(weight.dtype)
                setattr(base, attr, nn.Parameter(merged, requires_grad=False))
        with model.disable_adapter():
            yield model
    finally:
        for base, attr, weight in originals:
            setattr(base, attr, weight)


def adapter_weights(model: nn.Module) -> Iterator[tuple[str, str, torch.Tensor, float]]:
    """(the adapted weight's name in the plain model, "A" or "B", the adapter's matrix,
    scale) of every LoRA layer of a peft `model`: the weight it serves is W + scale * B @ A
    (A: (r, in), B: (out, r); peft's Linear delta), which a rollout server folds into its
    own copy of the frozen base (generation/server.py). Nothing for a model without adapters.
    An adapter of another shape (embedding, fan_in_fan_out, DoRA, two at once) is a
    ConfigError: it is not a plain B @ A on one weight."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for name, layer in base.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        active = [
            a for a in layer.active_adapters if a in layer.lora_A or a in layer.lora_embedding_A
        ]
        if not active:
            continue
        a = active[0]
        if (
            len(active) > 1
            or a not in layer.lora_A
            or getattr(layer, "fan_in_fan_out", False)
            or layer.use_dora.get(a, False)
        ):
            raise ConfigError(
                f"lora: {name}'s adapter is not one plain B @ A on a linear weight; a rollout "
                "server takes only those (lora.target_modules: linear layers)"
            )
        scale = float(layer.scaling[a])
        if hasattr(layer, "parameter_name"):  # fused experts (lora.experts): ParamWrapper
            yield expert_adapter_name(name, layer), "A", layer.lora_A[a].weight, scale
            yield expert_adapter_name(name, layer), "B", layer.lora_B[a].weight, scale
            continue
        yield f"{name}.weight", "A", layer.lora_A[a].weight, scale
        yield f"{name}.weight", "B", layer.lora_B[a].weight, scale


def expert_adapter_name(name: str, layer: nn.Module) -> str:
    """The plain model's name of the 3-D expert parameter a peft ParamWrapper at module
    `name` adapts (nested wrappers, one per parameter, sit at `...experts.base_layer`).
    Its A (r E, in) and B (out, r E) fold into the (E, out, in) weight expert by expert
    (serving/policy.py); experts stored (E, in, out) (gpt-oss) are refused: their factors
    fold transposed, which a server cannot tell from the shapes when in == out."""
    if not getattr(layer, "_did_swap_in_out_features", False):
        raise ConfigError(
            f"lora.experts: {name} stores its experts (experts, in, out); the rollout "
            "server's adapter sync takes (experts, out, in) only (set lora.experts=false)"
        )
    plain = ".".join(p for p in name.split(".") if p != "base_layer")
    return f"{plain}.{layer.parameter_name}"


def keep_4bit_differentiable(model: nn.Module) -> nn.Module:
    """Keep every bitsandbytes 4-bit layer of `model` on its differentiable matmul.

    bitsandbytes 0.50 on a CPU with AVX512-BF16 repacks a Linear4bit's weight into an
    inference layout at the layer's first eval-mode forward without gradients (a rollout),
    and from then on, training forwards included, multiplies with a kernel that has no
    autograd formula: the backward silently stops at every 4-bit layer, so the adapters
    below it (all of them, once the output projections cut the residual stream) get no
    gradient (optim/grad_norm_actor 0; docs/distributed.md, QLoRA). The repack is switched off
    here for a base whose adapters train. GPUs never take that path.
    """
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return model


def is_4bit(module: nn.Module) -> bool:
    """A bitsandbytes 4-bit layer (its weight carries a quantization state)."""
    return getattr(getattr(module, "weight", None), "quant_state", None) is not None


@torch.no_grad()
def nf4_round_trip(model: nn.Module) -> nn.Module:
    """`model` with the weight of every linear layer that a 4-bit load quantizes (all but
    the output head, models.nf4_load_kwargs) replaced by its NF4 quantize-dequantize: the
    weights a QLoRA base computed with, in the model's dtype, as plain tensors."""
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    for name, layer in model.named_modules():
        if isinstance(layer, nn.Linear) and not name.endswith("lm_head"):
            w = layer.weight
            packed, state = quantize_4bit(w.data.contiguous(), blocksize=64, quant_type="nf4")
            w.data = dequantize_4bit(packed, state).to(w.dtype).reshape(w.shape)
    return model


class AdapterOffReference(nn.Module):
    """The reference policy as the actor's base with adapters off: no second weight copy.

    Calls `actor_fn()` for the current (possibly ZeRO-3-hooked) actor module each time.
    """

    def __init__(self, actor_fn: Callable[[], nn.Module]):
        super().__init__()
        self._actor_fn = actor_fn

    @torch.no_grad()
    def forward(self, **kwargs: Any) -> Any:
        """The actor's forward (its output, whatever it returns) with adapters off."""
        actor = self._actor_fn()
        with adapters_disabled(actor):
            return actor(**kwargs)

    @contextlib.contextmanager
    def scoring_model(self) -> Iterator[nn.Module]:
        """The actor with adapters off, for `engine.forward.token_logprobs`: its backbone AND its
        output head (a LoRA-adapted lm_head too) run as the base inside."""
        actor = self._actor_fn()
        with torch.no_grad(), adapters_disabled(actor):
            yield actor


def export_lora(
    state: dict,
    prefix: str,
    build_base: Callable[[], nn.Module],
    lora_cfg: LoRAConfig,
    task_type: str,
    head: str | None,
    directory_merged: Path | None,
    directory_adapter: Path | None,
) -> None:
    """Rebuild the trained peft model on CPU from a (gathered) state dict and export it.

    state: full state dict of the training module; prefix: its key prefix for this model
    (e.g. "actor."); build_base(): a fresh copy of the base model. Writes the merged model
    (plain transformers checkpoint) and/or the adapter (PeftModel.from_pretrained).
    """
    base = build_base()
    own = sub_state_dict(state, prefix)
    if getattr(lora_cfg, "load_in_4bit", False):
        # QLoRA: the adapters were trained against the NF4 base; the export is that base
        # dequantized (in build_base's dtype) with the adapters merged, and the state's
        # packed 4-bit base weights are not loaded.
        base = nf4_round_trip(base)
        own = {k: v for k, v in own.items() if "lora_" in k or "modules_to_save" in k}
    model = add_adapters(base, lora_cfg, task_type, head)
    result = model.load_state_dict(own, strict=False)
    lost = [k for k in result.missing_keys if "lora_" in k or "modules_to_save" in k]
    if lost:
        raise RuntimeError(f"LoRA export: trained weights missing from the state dict: {lost[:3]}")
    if directory_adapter is not None:
        model.save_pretrained(directory_adapter, safe_serialization=True)
    if directory_merged is not None:
        merged = model.merge_and_unload()
        merged.save_pretrained(directory_merged, safe_serialization=True)


def dense_targets(model: nn.Module, targets: tuple[str, ...]) -> list[str]:
    """peft's target_modules for lora.target_modules of a model without experts: the names as given, or, in a
    vision-language model, the full names of the matching modules of its language model
    only (docs/vision.md: the vision tower's attention has q_proj/k_proj/v_proj too)."""
    if not any(is_vision_part(name) for name, _ in model.named_modules()):
        return list(targets)
    return language_model_modules(model, targets)
