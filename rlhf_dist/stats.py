"""Statistics over all ranks: sums with their counts, maxima, masked mean and variance.

Every logged mean is a SUM reduced over ranks divided by a COUNT reduced over ranks, so
it does not depend on how examples were split across ranks and micro-batches.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from typing import Protocol

import torch

from rlhf_dist.algo.masking import masked_sum


class Collectives(Protocol):
    """The part of distributed.Runtime these reductions use (this layer cannot import it)."""

    @property
    def device(self) -> torch.device: ...
    def all_sum(self, x: torch.Tensor) -> torch.Tensor: ...
    def all_max(self, x: torch.Tensor) -> torch.Tensor: ...


class RankedCollectives(Collectives, Protocol):
    """Collectives that also know this process's place among the ranks."""

    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...


class StatSums:
    """Sums (of tokens or sequences) with their counts, and maxima; reduced over ranks at once.

    Values may be tensors on the accelerator: they are kept there until `reduce`, so adding
    one never waits for the device (a float() per statistic would, several per micro-batch).
    """

    def __init__(self) -> None:
        self.sums: dict[str, list[float | torch.Tensor]] = defaultdict(list)
        self.maxima: dict[str, list[float | torch.Tensor]] = defaultdict(list)

    def add(self, name: str, total: float | torch.Tensor, count: float | torch.Tensor) -> None:
        """Add `total`, a sum over `count` tokens or sequences, to statistic `name`;
        `reduce` gives its mean: every rank's totals summed over every rank's counts summed."""
        self.sums[name + "/sum"].append(total)
        self.sums[name + "/n"].append(count)

    def add_max(self, name: str, value: float | torch.Tensor) -> None:
        """Add `value` to statistic `name`, whose reduced value is its maximum over ranks."""
        self.maxima[name].append(value)

    @classmethod
    def joined(cls, parts: Iterable[StatSums]) -> StatSums:
        """A new accumulator holding every part's values, in the parts' order (each
        statistic's float64 sum then adds them in the order one accumulator would have)."""
        out = cls()
        for part in parts:
            for name, values in part.sums.items():
                out.sums[name].extend(values)
            for name, values in part.maxima.items():
                out.maxima[name].extend(values)
        return out

    def reduce(self, runtime: Collectives) -> dict[str, float]:
        """Global means (sum over ranks / count over ranks) and global maxima."""
        keys = sorted(self.sums)
        local = [_stack(self.sums[k], runtime.device).sum() for k in keys]
        totals = runtime.all_sum(torch.stack(local)) if keys else torch.zeros(0)
        r = dict(zip(keys, totals.tolist()))
        out = {k[:-4]: r[k] / max(r[k[:-4] + "/n"], 1.0) for k in keys if k.endswith("/sum")}
        names = sorted(self.maxima)
        if names:
            local = torch.stack([_stack(self.maxima[k], runtime.device).max() for k in names])
            out |= dict(zip(names, runtime.all_max(local).tolist()))
        return out


def _stack(values: list[float | torch.Tensor], device: torch.device) -> torch.Tensor:
    """Numbers and 0-d tensors (any device) as one float64 vector on `device`."""
    return torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values])


def global_moments(
    runtime: Collectives, x: torch.Tensor, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(count, mean, sum of squared deviations) of `x` over ALL ranks' masked-in elements,
    0-dim float64; x and mask the same shape (mask None: every element).

    The one cross-rank mean and variance of the package (three collectives, two passes:
    the deviations are taken from the global mean, never as E[x^2] - E[x]^2, which cancels
    catastrophically). Every rank must call this.
    """
    x = x.to(torch.float64)
    mask = torch.ones_like(x, dtype=torch.bool) if mask is None else mask
    count = runtime.all_sum(mask.sum().to(torch.float64))
    mean = runtime.all_sum(masked_sum(x, mask)) / count
    sq_dev = runtime.all_sum(masked_sum((x - mean) ** 2, mask))
    return count, mean, sq_dev


def global_mean_var(
    runtime: Collectives, x: torch.Tensor, mask: torch.Tensor | None = None, unbiased: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked mean and variance of `x` over ALL ranks (`global_moments`), in x's dtype:
    var = sum((x - mean)^2) / (n - 1) if unbiased (Bessel), else / n (the population
    variance, as RunningMoments folds in). x, mask: (B, T) or (B,); mask None: all."""
    count, mean, sq_dev = global_moments(runtime, x, mask)
    var = sq_dev / (count - 1 if unbiased else count)
    return mean.to(x.dtype), var.to(x.dtype)


def global_top_k(runtime: RankedCollectives, keys: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest values of `keys` (any shape) over ALL ranks, (k,) float64, descending;
    -inf fills the places of a world with fewer than k values. Every rank must call this
    with the same k.

    The global top k lies within the union of every rank's own top k: each rank puts its
    k best into its row of a (world, k) table of -inf and one all-max gathers the table
    exactly (no float additions), so the result does not depend on how the values are
    spread over ranks. Costs world x k numbers: for a small share of the tokens
    (ppo.cov_ratio), not for sorting a whole batch.
    """
    flat = keys.detach().reshape(-1).to(torch.float64)
    table = torch.full((runtime.world_size, k), -math.inf, dtype=torch.float64, device=flat.device)
    n = min(k, flat.numel())
    if n:
        table[runtime.rank, :n] = flat.topk(n).values
    gathered = runtime.all_max(table).reshape(-1)
    return gathered.topk(k).values
