"""The routers' load-balancing loss in a training step (docs/moe.md, algo/moe.py): the
expert token fractions of the whole global batch first, then each micro-batch's share
added to its loss, split-invariantly like every other loss here (docs/architecture.md
section 4).

The fractions are counts over every micro-batch of every rank. A micro-batch's own
forward cannot know the others' counts before its backward, so with more than one
micro-batch or rank a no-grad forward of each micro-batch counts them first (one extra
forward per micro-batch while model.router_aux_loss_coef > 0; one micro-batch on one
rank counts from its own forward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from rlhf_dist.distributed import Runtime
from rlhf_dist.engine.forward import causal_lm
from rlhf_dist.models.moe import RouterAux, router_aux
from rlhf_dist.stats import StatSums
from rlhf_dist.trainers.common import share_of_global_mean

METRIC = "loss/router_aux"  # the global batch's load-balancing loss, before its coefficient


def trained_router_aux(coef: float | None, model: nn.Module) -> RouterAux | None:
    """The RouterAux of a trained causal LM (wrapped or not; an ActorCritic's actor) at
    model.router_aux_loss_coef `coef`, or None for a dense model or a coefficient of 0."""
    inner = getattr(model, "module", model)
    return router_aux(coef, causal_lm(getattr(inner, "actor", inner)))


@dataclass(frozen=True)
class StepRouting:
    """One optimizer step's load-balancing state: the global fractions f (L, E) and real
    token count N, or None and None to count from the one micro-batch's own forward."""

    aux: RouterAux
    fractions: torch.Tensor | None
    tokens: torch.Tensor | None

    def loss(
        self,
        runtime: Runtime,
        records: list[torch.Tensor],
        attention_mask: torch.Tensor,
        stats: StatSums,
        columns: int | None = None,
    ) -> torch.Tensor:
        """This micro-batch's share of coef x the loss, to add to its loss before backward
        (x world size / N as `share_of_global_mean`); adds `loss/router_aux` to `stats`.
        records: its forward's router logits; attention_mask: (B, L) of that forward;
        columns: count only its last `columns` columns (an RL update's responses)."""
        weighted, raw, real = self.aux.loss_sum(records, attention_mask, columns, self.fractions)
        n = real.clamp(min=1) if self.tokens is None else self.tokens
        stats.add(METRIC, raw, real)  # sum over micro-batches and ranks / N: the loss
        return share_of_global_mean(runtime, weighted, n)


def step_routing(
    runtime: Runtime,
    aux: RouterAux | None,
    masks: list[torch.Tensor],
    forward: Callable[[int], object],
    columns: list[int] | None = None,
) -> StepRouting | None:
    """The StepRouting of a step whose micro-batches have attention masks `masks` (B, L)
    and run as `forward(i)` (columns: the counted last columns of each, None: all); None
    without a RouterAux."""
    if aux is None:
        return None
    if len(masks) == 1 and runtime.world_size == 1:
        return StepRouting(aux, None, None)
    widths: list[int | None] = list(columns) if columns else [None] * len(masks)
    counted = list(zip(masks, widths, strict=True))
    fractions, tokens = aux.global_fractions(runtime.all_sum, counted, forward)
    return StepRouting(aux, fractions, tokens)


@contextlib.contextmanager
def recording(routing: StepRouting | None) -> Iterator[list[torch.Tensor]]:
    """The router logits of the forwards run inside ([] and nothing hooked without one)."""
    if routing is None:
        yield []
        return
    with routing.aux.recording() as records:
        yield records
