"""Statistics over all ranks: sums with their counts, maxima, masked mean and variance.

Every logged mean is a SUM reduced over ranks divided by a COUNT reduced over ranks, so
it does not depend on how examples were split across ranks and micro-batches.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from rlhf_dist.algo.masking import masked_sum


class StatSums:
    """Sums (of tokens or sequences) with their counts, and maxima; reduced over ranks at once.

    Values may be tensors on the accelerator: they are kept there until `reduce`, so adding
    one never waits for the device (a float() per statistic would, several per micro-batch).
    """

    def __init__(self):
        self.sums: dict[str, list] = defaultdict(list)
        self.maxima: dict[str, list] = defaultdict(list)

    def add(self, name: str, total, count) -> None:
        self.sums[name + "/sum"].append(total)
        self.sums[name + "/n"].append(count)

    def add_max(self, name: str, value) -> None:
        self.maxima[name].append(value)

    def reduce(self, runtime) -> dict[str, float]:
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


def _stack(values: list, device) -> torch.Tensor:
    """Numbers and 0-d tensors (any device) as one float64 vector on `device`."""
    return torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values])


def global_mean_var(
    runtime, x: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked mean and unbiased variance of `x` over ALL ranks' tokens; x, mask (B, T)."""
    count = runtime.all_sum(mask.sum().to(torch.float64))
    mean = runtime.all_sum(masked_sum(x.to(torch.float64), mask)) / count
    sq_dev = runtime.all_sum(masked_sum((x.to(torch.float64) - mean) ** 2, mask))
    return mean.to(x.dtype), (sq_dev / (count - 1)).to(x.dtype)
