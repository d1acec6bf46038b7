"""Mixture-of-experts models (docs/moe.md): recognised from their config, their sparse
blocks found and made ZeRO-3 leaf modules, and the routers' load-balancing loss.

A sparse block is a module with an `experts` child and a router child (`gate` or
`router`): Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3 (`gate`) and gpt-oss
(`router`) in transformers 5, and the module-list layouts of remote-code models alike.
The router's forward returns its logits (N, E), alone or first of a tuple.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rlhf_dist.algo.moe import expert_counts, load_balancing_sum, router_prob_sums
from rlhf_dist.config import ModelConfig
from rlhf_dist.distributed.backend import mark_leaf_modules
from rlhf_dist.errors import ConfigError

# config.json keys of the number of routed experts and of experts per token, by family
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "moe_top_k")  # not "top_k": a sampling default
# model_type of the families whose sparse blocks are known (tests/unit/test_unit_moe.py)
KNOWN_FAMILIES = (
    "qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "gpt_oss", "deepseek_v3", "deepseek_v2",
)  # fmt: skip
ROUTER_NAMES = ("gate", "router")


@dataclass(frozen=True)
class ExpertShape:
    """What a config says about its experts: E routed experts, top_k per token, the
    model_type and the config's own load-balancing weight (0 where it has none)."""

    num_experts: int
    top_k: int
    model_type: str
    aux_coef: float


def expert_shape(config: Any) -> ExpertShape | None:
    """The experts of a transformers config (its text_config for multimodal ones), or None
    for a dense model (no expert count above 1)."""
    config = getattr(config, "text_config", None) or config
    experts = next((getattr(config, k) for k in EXPERT_KEYS if getattr(config, k, None)), 0)
    if not isinstance(experts, int) or experts <= 1:
        return None
    top_k = next((getattr(config, k) for k in TOP_K_KEYS if getattr(config, k, None)), 1)
    coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
    return ExpertShape(experts, int(top_k), str(getattr(config, "model_type", "")), coef)


def sparse_blocks(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """(block, router) of every sparse block of `model`, in forward order."""
    found = []
    for module in model.modules():
        router = next((getattr(module, n) for n in ROUTER_NAMES if hasattr(module, n)), None)
        if isinstance(getattr(module, "experts", None), nn.Module) and isinstance(
            router, nn.Module
        ):
            found.append((module, router))
    return found


def prepare_moe(model: nn.Module, source: ModelConfig | None, key: str) -> None:
    """Make `model`'s sparse blocks ZeRO-3 leaf modules (a no-op outside DeepSpeed
    launches, and for dense models). model.moe_leaf_modules names the classes instead.
    A config that declares experts with no block found is one ConfigError naming that
    key, never a run that may hang; an unknown family's blocks are used, said once."""
    declared = tuple(getattr(source, "moe_leaf_modules", ()) or ())
    shape = expert_shape(getattr(model, "config", None))
    if shape is None and not declared:
        return
    if declared:
        by_name = {type(m).__name__: type(m) for m in model.modules()}
        missing = [n for n in declared if n not in by_name]
        if missing:
            raise ConfigError(f"model.moe_leaf_modules: no module of class {missing} in {key}")
        classes = [by_name[n] for n in declared]
    else:
        classes = sorted({type(b) for b, _ in sparse_blocks(model)}, key=lambda c: c.__name__)
    if not classes:
        raise ConfigError(
            f"{key}: its config declares {shape.num_experts if shape else '?'} experts but no "
            "sparse block (a module with `experts` and `gate`/`router`) was found; name its "
            "class in model.moe_leaf_modules"
        )
    if shape is not None and shape.model_type not in KNOWN_FAMILIES and not declared:
        names = [c.__name__ for c in classes]
        _say_once(
            f"{key}: mixture-of-experts family {shape.model_type!r} is not one rlhf_dist knows; "
            f"{names} taken as its sparse blocks (ZeRO-3 leaf modules); set "
            "model.moe_leaf_modules to name them yourself"
        )
    mark_leaf_modules(model, classes)


_SAID: set[str] = set()


def _say_once(line: str) -> None:
    if line not in _SAID:
        _SAID.add(line)
        print(line, flush=True)


@dataclass(frozen=True)
class RouterAux:
    """The load-balancing loss of one trained model (algo/moe.py): coef x the mean over
    its MoE layers of E x sum_i f_i P_i, f counted over the whole global batch."""

    coef: float
    top_k: int
    num_experts: int
    routers: tuple[nn.Module, ...]

    @contextmanager
    def recording(self, with_grad: bool = True) -> Iterator[list[torch.Tensor]]:
        """Collect each router's logits (N, E) of the forwards run inside, in layer order
        (one forward per micro-batch; hooks removed on exit, so a checkpointed layer's
        recomputation in backward records nothing). with_grad: only forwards run with
        gradients (the trained one, not a no-grad reference pass through the same
        routers, as LoRA's adapters-off reference is)."""
        records: list[torch.Tensor] = []

        def hook(_m: nn.Module, _args: Any, out: Any) -> None:
            if torch.is_grad_enabled() or not with_grad:
                records.append(out[0] if isinstance(out, tuple) else out)

        handles = [r.register_forward_hook(hook) for r in self.routers]
        try:
            yield records
        finally:
            for h in handles:
                h.remove()

    def masked(
        self, records: list[torch.Tensor], attention_mask: torch.Tensor, columns: int | None
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """(one forward's router logits, one (N, E) per layer; the (N,) mask of the tokens
        counted) from a micro-batch's records and its (B, L) attention mask. columns: count
        only the last `columns` columns (an RL update's response tokens; the forward may run
        the prompts first, perf.shared_prompt_forward: then its second forward's records,
        the responses', are the ones kept); None: every real token of the one forward."""
        layers = len(self.routers)
        if columns is not None and len(records) == 2 * layers:
            records = records[layers:]
        if len(records) != layers:
            raise ConfigError(
                f"model.router_aux_loss_coef: {len(records)} router calls in a forward of "
                f"{layers} MoE layers (set perf.shared_prompt_forward=false, or the key to 0)"
            )
        n, (rows, width) = records[0].shape[0], attention_mask.shape
        mask = attention_mask
        if columns is not None and n == rows * columns:
            mask = attention_mask[:, width - columns :]
        elif columns is not None:
            mask = torch.cat(
                [torch.zeros_like(mask[:, : width - columns]), mask[:, width - columns :]], 1
            )
        if mask.numel() != n:
            raise ConfigError(
                "model.router_aux_loss_coef: the load-balancing loss needs padded forwards "
                "(set perf.packed_sequences=false and distributed.sequence_parallel_size=1, "
                "or the key to 0)"
            )
        return records, mask.reshape(-1)

    def counts(
        self, records: list[torch.Tensor], attention_mask: torch.Tensor, columns: int | None
    ) -> torch.Tensor:
        """Tokens routed to each expert, (L, E) float64, of one recorded forward (`masked`)."""
        records, mask = self.masked(records, attention_mask, columns)
        return torch.stack([expert_counts(x, self.top_k, mask) for x in records])

    def global_fractions(
        self,
        all_sum: Callable[[torch.Tensor], torch.Tensor],
        masks: list[tuple[torch.Tensor, int | None]],
        forward: Callable[[int], object],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(f (L, E), N): expert token fractions over the global batch and its counted
        token total, from a no-grad forward of each micro-batch i (`forward(i)`; masks[i]:
        its (B, L) attention mask and counted columns, `masked`), summed over micro-batches,
        then over ranks (`all_sum`). Under ZeRO-3 every rank runs as many forwards as it
        trains micro-batches: in lock-step."""
        total = torch.zeros(len(self.routers), self.num_experts, dtype=torch.float64)
        tokens = torch.zeros((), dtype=torch.float64)
        for i, (mask, columns) in enumerate(masks):
            with torch.no_grad(), self.recording(with_grad=False) as records:
                forward(i)
            records, flat = self.masked(records, mask, columns)
            total = total + torch.stack([expert_counts(x, self.top_k, flat) for x in records]).cpu()
            tokens = tokens + float(flat.sum())
        device = masks[0][0].device if masks else torch.device("cpu")
        reduced = all_sum(torch.cat([total.reshape(-1), tokens.reshape(1)]).to(device))
        n = reduced[-1].clamp(min=1.0)
        return reduced[:-1].reshape(total.shape) / n, n

    def loss_sum(
        self,
        records: list[torch.Tensor],
        attention_mask: torch.Tensor,
        columns: int | None,
        fractions: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(coef x this micro-batch's share x N, the same unweighted and detached, its
        counted tokens): divide by the global count N (and x world size,
        share_of_global_mean). With no `fractions` (one micro-batch on one rank) f comes
        from this forward itself."""
        records, mask = self.masked(records, attention_mask, columns)
        if fractions is None:
            counts = torch.stack([expert_counts(x, self.top_k, mask) for x in records])
            fractions = counts / mask.sum().clamp(min=1)
        sums = torch.stack([router_prob_sums(x, mask) for x in records])
        raw = load_balancing_sum(sums, fractions.to(sums.device))
        return self.coef * raw, raw.detach(), mask.sum()


def router_aux(coef: float | None, lm: nn.Module) -> RouterAux | None:
    """The RouterAux of trained causal LM `lm` (its transformers model), or None: a dense
    model, or a coefficient (model.router_aux_loss_coef; None: the model config's) of 0."""
    shape = expert_shape(getattr(lm, "config", None))
    if shape is None:
        return None
    coef = shape.aux_coef if coef is None else coef
    routers = tuple(r for _, r in sparse_blocks(lm))
    if not coef or not routers:
        return None
    return RouterAux(coef, shape.top_k, shape.num_experts, routers)
