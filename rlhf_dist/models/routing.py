"""Routing replay for mixture-of-experts models: record the top-k expert choice of every
router in a forward, force a recorded choice in a later forward, and the router metrics
(docs/moe.md, "Routing replay").

transformers 5 gives every sparse block of Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE, gpt-oss
and the other families of ROUTER_RULES one router module (`mlp.gate`, `mlp.router`), whose forward takes the
flattened hidden states (N, H) and returns (router_logits (N, E), top-k weights (N, k),
top-k expert indices (N, k)); the fused experts then run on those indices and weights. A
forward hook on that module sees every routing decision and may replace it, so one
mechanism records and replays all of them, whatever the block does around its router.

Replay keeps the router differentiable as in verl's and slime's R2/R3: the indices are
forced, the weights are still the current softmax over all E experts gathered at the
forced indices (renormalised over them when the router normalises its top-k), so the
router's parameters keep a gradient through the weights of the experts it is made to use.

Layouts: a recording of a forward of B rows of S tokens is (B, S, L, k) int64 for L
routed layers; -1 marks a token whose routing was not recorded (the last sampled token,
which no forward fed; padding), and replay leaves the router's own choice there.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from rlhf_dist.config import PerfConfig
from rlhf_dist.distributed import Runtime
from rlhf_dist.errors import ConfigError
from rlhf_dist.stats import StatSums


@dataclass(frozen=True)
class WeightRule:
    """How a router family turns its logits (N, E) into the top-k weights (N, k), read
    from its transformers 5.19 forward: a softmax over all E experts in float32 gathered
    at the top-k (renormalised over them always, or when the router's `norm_topk_prob`
    says so; cast back to the logits' dtype or left float32), or a softmax over the top-k
    logits alone (gpt-oss)."""

    over_topk: bool = False
    always_normalise: bool = False
    cast: bool = True


# The router classes whose forward returns (logits, weights, indices), each with its rule;
# another *TopKRouter is not hooked (its weights may be computed otherwise).
ROUTER_RULES = {
    "Qwen2MoeTopKRouter": WeightRule(),
    "Qwen3MoeTopKRouter": WeightRule(),
    "Qwen3NextTopKRouter": WeightRule(),
    "OlmoeTopKRouter": WeightRule(),
    "FlexOlmoTopKRouter": WeightRule(),
    "Qwen3_5MoeTopKRouter": WeightRule(always_normalise=True),
    "MixtralTopKRouter": WeightRule(always_normalise=True, cast=False),
    "MiniMaxTopKRouter": WeightRule(always_normalise=True, cast=False),
    "GptOssTopKRouter": WeightRule(over_topk=True),
}


def routers(model: nn.Module) -> list[nn.Module]:
    """The routers of `model` in layer order (empty for a dense model or a family not in
    ROUTER_RULES)."""
    return [m for m in model.modules() if type(m).__name__ in ROUTER_RULES]


def is_moe(model: nn.Module) -> bool:
    """Whether `model` routes tokens to experts through routers this module can hook."""
    return bool(routers(model))


def require_routers(model: nn.Module, what: str) -> None:
    """ConfigError naming `what` (the config key and value) unless `model` has routers
    to replay and does not recompute its forward in backward (gradient checkpointing runs
    the routers again after the replay span has closed)."""
    if not is_moe(model):
        raise ConfigError(
            f"{what}: needs a mixture-of-experts model.policy whose routers it knows "
            f"(Qwen2/3-MoE, Mixtral, OLMoE, gpt-oss, ...: models/routing.py ROUTER_RULES); "
            f"{type(model).__name__} has none"
        )
    if any(getattr(m, "is_gradient_checkpointing", False) for m in model.modules()):
        raise ConfigError(f"{what}: needs model.gradient_checkpointing false")


def routing_shape(model: nn.Module) -> tuple[int, int]:
    """(L routed layers, k experts per token) of `model`."""
    found = routers(model)
    return len(found), int(found[0].top_k) if found else 0


def forced_weights(router: nn.Module, logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The top-k weights (N, k) `router` gives the experts `index` (N, k) from its logits
    (N, E), by its family's WeightRule. With `index` the router's own top-k this is its own
    output bit for bit (the same elements, in the same order, through the same ops)."""
    rule = ROUTER_RULES[type(router).__name__]
    if rule.over_topk:  # gpt-oss: softmax over the chosen logits only
        return torch.softmax(logits.gather(-1, index), dim=1, dtype=logits.dtype)
    top = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, index)
    if rule.always_normalise or getattr(router, "norm_topk_prob", False):
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype) if rule.cast else top


class RoutingSpan:
    """A context manager hooking every router of a model while it is open: it records
    each forward's routing and, given `forced`, replays it (`recording`, `replaying`).

    Each forward appends, per layer, the indices it used (N, k) and, where it replayed,
    the router's own top-k (N, k), so a replayed span also measures how many tokens the
    recording flipped (`flips`)."""

    def __init__(self, forced: list[torch.Tensor] | None, keep_logits: bool = False) -> None:
        self.forced, self.keep_logits = forced, keep_logits
        self.routers: list[nn.Module] = []
        self.calls: list[list[torch.Tensor]] = []
        self.own: list[list[torch.Tensor]] = []
        self.logits: list[list[torch.Tensor]] = []
        self.handles: list[Any] = []

    def on(self, model: nn.Module) -> RoutingSpan:
        """This span over the routers of `model` (the actor, not a critic beside it);
        ValueError for a model without routers."""
        self.routers = routers(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no router to record or replay")
        self.calls, self.own, self.logits = ([[] for _ in self.routers] for _ in range(3))
        return self

    def __enter__(self) -> RoutingSpan:
        self.handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _hook(self, layer: int) -> Any:
        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            logits, weights, index = output
            self.own[layer].append(index.detach())
            if self.forced is not None:
                index, weights = self._replay(module, layer, logits, index)
            self.calls[layer].append(index.detach())
            if self.keep_logits:
                self.logits[layer].append(logits.detach())
            return logits, weights, index

        return hook

    def _replay(
        self, module: nn.Module, layer: int, logits: torch.Tensor, own: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.forced is not None
        call = len(self.calls[layer])
        if call >= len(self.forced):
            raise RuntimeError(
                f"routing replay: forward {call + 1} of a recording of {len(self.forced)}"
            )
        want = self.forced[call][:, :, layer].reshape(-1, own.shape[-1]).to(own.device)
        if want.shape != own.shape:
            raise ValueError(
                f"routing replay: layer {layer} routes {tuple(own.shape)} token choices, "
                f"the recording has {tuple(want.shape)}"
            )
        index = torch.where(want >= 0, want, own)
        return index, forced_weights(module, logits, index)

    def recorded(self, rows: int) -> torch.Tensor:
        """(rows, S, L, k): the indices every forward used, joined along the tokens (S:
        the tokens of all forwards, each of which ran the same `rows` rows)."""
        return _joined(self.calls, rows)

    def router_choice(self, rows: int) -> torch.Tensor:
        """(rows, S, L, k): the routers' own top-k, before any replay (as `recorded`)."""
        return _joined(self.own, rows)

    def flips(self, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens x layers whose replayed expert set differs from the routers' own choice,
        tokens x layers counted) over the last T columns of the span's forwards, the tokens
        mask (B, T) marks: the flips a replay prevented."""
        B, T = mask.shape
        own, used = self.router_choice(B)[:, -T:], self.recorded(B)[:, -T:]
        flipped = (own.sort(-1).values != used.sort(-1).values).any(-1)  # (B, T, L)
        counted = mask.bool()[:, :, None].expand_as(flipped)
        return (flipped & counted).sum().double(), counted.sum().double()

    def router_logits(self) -> list[torch.Tensor]:
        """Per layer, the router logits (N, E) of every forward's tokens, joined
        (`keep_logits`)."""
        return [torch.cat(layer) for layer in self.logits]


def _joined(calls: list[list[torch.Tensor]], rows: int) -> torch.Tensor:
    """Per-layer lists of per-forward (rows x S_c, k) indices -> (rows, sum S_c, L, k)."""
    L, k = len(calls), calls[0][0].shape[-1]
    per_call = [
        torch.stack([layer[c] for layer in calls], dim=1).reshape(rows, -1, L, k)
        for c in range(len(calls[0]))
    ]
    return torch.cat(per_call, dim=1)


def recording(keep_logits: bool = False) -> RoutingSpan:
    """A span (bind it with `on(model)`) recording every routing decision of the model's
    forwards while open; after it `recorded(rows)` gives them as (rows, S, L, k), and
    with `keep_logits` `router_logits()` the router logits (router entropy)."""
    return RoutingSpan(None, keep_logits)


def replaying(forced: list[torch.Tensor], keep_logits: bool = False) -> RoutingSpan:
    """A span (bind it with `on(model)`) forcing the routing of the model's forwards while
    open: forward i takes the indices forced[i] (B, S, L, k) of its B rows and S tokens
    (-1: the router's own choice). What was used and what the routers chose are recorded
    as by `recording`."""
    return RoutingSpan(list(forced), keep_logits)


def plain_path(perf: PerfConfig) -> PerfConfig:
    """`perf` with the speed paths that change a forward's token layout off (shared
    prompts run once per distinct prompt, packed rows): a recorded or replayed forward
    runs each row's P + T tokens in place, the layout a recording is kept in."""
    return replace(perf, shared_prompt_forward=False, packed_sequences=False)


def expert_counts(index: torch.Tensor, mask: torch.Tensor, experts: int) -> torch.Tensor:
    """How many routed token slots each expert got, per layer: (L, E) float64. index:
    (B, S, L, k) with -1 unrecorded (not counted); mask: (B, S) bool, the tokens counted."""
    L = index.shape[2]
    picked = index[mask.bool()]  # (N, L, k)
    counts = torch.zeros(L, experts + 1, dtype=torch.float64, device=index.device)
    slots = torch.where(picked >= 0, picked, experts).permute(1, 0, 2).reshape(L, -1)
    counts.scatter_add_(1, slots, torch.ones_like(slots, dtype=torch.float64))
    return counts[:, :experts]


def expert_load(index: torch.Tensor, mask: torch.Tensor, experts: int) -> torch.Tensor:
    """The fraction of routed token slots each expert got, per layer: (L, E), rows sum to
    1 (0 without a token); arguments as `expert_counts`."""
    counts = expert_counts(index, mask, experts)
    return counts / counts.sum(dim=1, keepdim=True).clamp_min(1)


def router_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (N,) in nats of each token's routing distribution softmax(logits) over the
    E experts; logits: (N, E)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def flip_rate(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per layer, the fraction (L,) of counted tokens whose expert set differs between two
    routings a and b (B, S, L, k) of the same tokens (order within the k ignored); tokens
    unrecorded (-1) in either do not count. mask: (B, S) bool."""
    sa, sb = a.sort(dim=-1).values, b.sort(dim=-1).values
    known = (sa >= 0).all(-1) & (sb >= 0).all(-1) & mask.bool()[:, :, None]  # (B, S, L)
    flipped = (sa != sb).any(-1) & known
    return flipped.sum((0, 1)).double() / known.sum((0, 1)).double().clamp_min(1)


def experts_of(model: nn.Module) -> int:
    """E, the experts each router of `model` chooses among (0 for a dense model)."""
    found = routers(model)
    return int(getattr(found[0], "num_experts", found[0].weight.shape[0])) if found else 0


def router_stats(
    runtime: Runtime,
    mask: torch.Tensor,
    routing: torch.Tensor | None,
    entropy: torch.Tensor | None,
    flips: torch.Tensor | None,
    experts: int,
) -> dict[str, float]:
    """Per-layer router metrics of a rollout over all ranks (docs/moe.md; {} without a
    recorded routing): router/load_max/layer_l and router/load_min/layer_l, the largest
    and smallest share of routed token slots an expert got (1/E each when balanced);
    router/entropy/layer_l, the mean routing entropy in nats; with r3
    router/flip_rate/layer_l and router/flip_rate, the share of tokens whose top-k set
    the trainer would choose differently from the sampler. mask: (B, T) bool response
    tokens; routing: (B, T, L, k) the routing used; entropy (B, T, L); flips (B, T, L)
    bool. A collective: every rank calls it."""
    if routing is None or entropy is None:
        return {}
    s, L = StatSums(), routing.shape[2]
    counts = runtime.all_sum(expert_counts(routing, mask, experts))  # (L, E) over all ranks
    share = counts / counts.sum(dim=1, keepdim=True).clamp_min(1)
    out: dict[str, float] = {}
    n = mask.sum()
    for layer in range(L):
        out[f"router/load_max/layer_{layer}"] = float(share[layer].max())
        out[f"router/load_min/layer_{layer}"] = float(share[layer].min())
        s.add(f"router/entropy/layer_{layer}", entropy[..., layer][mask.bool()].sum(), n)
        if flips is not None:
            s.add(f"router/flip_rate/layer_{layer}", flips[..., layer][mask.bool()].sum(), n)
    if flips is not None:
        s.add("router/flip_rate", flips[mask.bool()].float().sum(), n * L)
    return out | s.reduce(runtime)


def logprob_gap_stats(
    runtime: Runtime,
    mask: torch.Tensor,
    sampler: torch.Tensor | None,
    replayed: torch.Tensor | None,
    unreplayed: torch.Tensor | None,
) -> dict[str, float]:
    """The sampler-vs-trainer log-prob gap with routing replay (the trainer's old
    log-probs, `replayed`) and without it (`unreplayed`), mean |log pi_trainer - log
    pi_sampler| over the response tokens of all ranks: router/logprob_gap_replayed and
    router/logprob_gap_unreplayed ({} unless all three (B, T) are given; mask (B, T))."""
    if sampler is None or replayed is None or unreplayed is None:
        return {}
    s, m, n = StatSums(), mask.bool(), mask.sum()
    s.add("router/logprob_gap_replayed", (replayed - sampler).abs()[m].sum(), n)
    s.add("router/logprob_gap_unreplayed", (unreplayed - sampler).abs()[m].sum(), n)
    return s.reduce(runtime)
