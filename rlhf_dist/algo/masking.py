"""Statistics over the real (masked-in) positions of a tensor.

Padding must never leak into a statistic (TRL #2022 reported negative entropy because
padded positions held a sentinel value that was averaged in), so everything here
multiplies by the mask and divides by the mask's count.
"""

from __future__ import annotations

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `x` over positions where `mask` is True; `x`, `mask` same shape."""
    # torch.where, not x * mask: a NaN/inf at a padded position must not poison the sum.
    x = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return x.sum() if dim is None else x.sum(dim=dim)


def last_token_index(response_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last True position of each row; response_mask (B, T) -> (B,) int64.

    The one "last real token" of the package: the reward is read there, the sequence score
    added there. Found from the MASK alone (any mask: a response mask, or the attention
    mask of a right-padded or prompt+response sequence), never by comparing ids with PAD,
    which real tokenizers share with EOS. Rows with no True position give 0 (check
    `response_mask.any(-1)` before using it).
    """
    T = response_mask.shape[-1]
    positions = torch.arange(T, device=response_mask.device).expand_as(response_mask)
    return torch.where(response_mask.bool(), positions, -1).amax(dim=-1).clamp(min=0)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(x*mask)/sum(mask) over `dim` (all elements if None).

    x, mask: same shape, e.g. (B, T). Returns a 0-dim tensor, or x reduced over `dim`.
    An empty mask gives 0/0 = NaN, as a plain mean of nothing would.
    """
    count = mask.to(x.dtype).sum() if dim is None else mask.to(x.dtype).sum(dim=dim)
    return masked_sum(x, mask, dim) / count


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked-in elements of `x` (all dims); Bessel-corrected if unbiased.

    x, mask: same shape. Returns a 0-dim tensor.
    """
    mean = masked_mean(x, mask)
    sq_dev = masked_sum((x - mean) ** 2, mask)
    count = mask.to(x.dtype).sum()
    if unbiased:
        # Bessel's correction n/(n-1); with a single element the variance is undefined.
        count = count - 1
    return sq_dev / count


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, keep_mean: bool = False, eps: float = 1e-8
) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) with the masked, unbiased mean and variance.

    Adds the mean back when `keep_mean` (used for rewards, whose sign matters).
    x, mask: same shape, e.g. (B, T). Positions outside the mask are 0 in the result.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    return whiten_with(x, mask, mean, var, keep_mean=keep_mean, eps=eps)


def whiten_with(
    x: torch.Tensor,
    mask: torch.Tensor,
    mean: torch.Tensor,
    var: torch.Tensor,
    keep_mean: bool = False,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Whiten `x` with a given mean and variance (e.g. reduced over all ranks).

    x, mask: same shape; mean, var: 0-dim. Positions outside the mask are 0.
    """
    out = (x - mean) * torch.rsqrt(var + eps)
    if keep_mean:
        out = out + mean
    return torch.where(mask.bool(), out, torch.zeros((), dtype=out.dtype, device=out.device))


class RunningMoments:
    """Running mean and variance over a stream of batches (Chan et al. 1979 combination).

    Used for online reward normalisation: scores are divided by a std that keeps adapting
    as the policy (and so the score distribution) moves. Plain floats; callers reduce each
    batch's (mean, var, count) over ranks first so every rank holds the same moments.
    """

    def __init__(self) -> None:
        self.mean, self.var, self.count = 0.0, 1.0, 0.0

    def update(self, batch_mean: float, batch_var: float, batch_count: float) -> None:
        """Fold in a batch with population variance `batch_var` of `batch_count` values."""
        if batch_count <= 0:
            return
        total = self.count + batch_count
        delta = batch_mean - self.mean
        m2 = (
            self.var * self.count
            + batch_var * batch_count
            + delta**2 * self.count * batch_count / total
        )
        self.mean += delta * batch_count / total
        self.var, self.count = m2 / total, total

    def state_dict(self) -> dict:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.var, self.count = (
            float(state["mean"]),
            float(state["var"]),
            float(state["count"]),
        )


def pack_masked(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's masked entries moved, in order, to the front of the row.

    x: (B, T), mask: (B, T) bool -> (packed (B, T), packed_mask (B, T) bool) with
    packed[b, :n_b] = x[b][mask[b]] (n_b = mask[b].sum()), packed_mask[b, t] = t < n_b and
    packed = 0 after n_b. A mask with gaps (the tool tokens of a multi-turn episode,
    docs/agents.md) becomes a prefix mask over the same entries; a prefix mask stays as it
    is. `unpack_masked` is its inverse on the masked entries.
    """
    mask = mask.bool()
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)  # masked first, in order
    count = mask.sum(1, keepdim=True)
    packed_mask = torch.arange(mask.shape[1], device=mask.device) < count
    packed = torch.gather(x, 1, order)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    return torch.where(packed_mask, packed, zero), packed_mask


def unpack_masked(packed: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T): out[b, t] = packed[b, k] where t is row b's k-th masked position, 0 where
    mask is False; packed (B, T) as pack_masked gives it, mask (B, T) bool."""
    mask = mask.bool()
    rank = (torch.cumsum(mask.long(), dim=1) - 1).clamp(min=0)
    out = torch.gather(packed, 1, rank)
    return torch.where(mask, out, torch.zeros((), dtype=packed.dtype, device=packed.device))
