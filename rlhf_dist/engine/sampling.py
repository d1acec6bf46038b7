"""Drawing the next token: temperature, EOS suppression, top-k / nucleus truncation
(`sample_next`, `truncate_logits`) and the inverse-CDF categorical draw
(`sample_categorical`: one uniform a row instead of torch.multinomial's one exponential
per vocabulary entry).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeAlias

import torch

from rlhf_dist.algo.logprobs import scale_logits

# [(generator, n)] over a batch's rows in order: each generator draws its n rows' random
# numbers (`sample_categorical`); None where the global RNG draws them all.
Streams: TypeAlias = Sequence[tuple[torch.Generator, int]]


class Sampling(Protocol):
    """The sampling keys the decode loop reads: a GenerationConfig, or a judge's greedy
    settings (rewards/judge.py), which are no config section."""

    @property
    def max_new_tokens(self) -> int: ...
    @property
    def min_new_tokens(self) -> int: ...
    @property
    def temperature(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def top_p(self) -> float: ...


def sample_next(
    logits: torch.Tensor,
    gen_cfg: Sampling,
    eos_id: int | torch.Tensor,
    allow_eos: bool,
    streams: Streams | None = None,
) -> torch.Tensor:
    """One token per row, (B,), drawn from softmax(logits / temperature) after EOS
    suppression (min_new_tokens) and top-k / top-p truncation; logits (B, V). eos_id: one
    id or a (S,) tensor of stop ids, all suppressed alike. streams: the rows' random draws
    (sample_categorical; None: the global RNG's)."""
    logits = scale_logits(logits, gen_cfg.temperature)
    if not truncates(gen_cfg.top_k, gen_cfg.top_p, logits.shape[-1]):
        # No truncation: suppressing EOS is zeroing its probability (the sampler takes
        # unnormalised rows), in the softmax's own output: no copy of the logits.
        probs = torch.softmax(logits, dim=-1)
        if not allow_eos:
            probs[:, eos_id] = 0.0
        return sample_categorical(probs, streams=streams)
    if not allow_eos:  # truncation must see the distribution without EOS
        logits = logits.clone()  # scale_logits may return the model's own tensor
        logits[:, eos_id] = float("-inf")
    logits = truncate_logits(logits, gen_cfg.top_k, gen_cfg.top_p)
    return sample_categorical(torch.softmax(logits, dim=-1), streams=streams)


def sample_categorical(
    probs: torch.Tensor, block: int = 256, streams: Streams | None = None
) -> torch.Tensor:
    """One index per row of probs (B, V) -> (B,), drawn by inverting the CDF: one uniform
    per row, located first among the float64 cumulative masses of blocks of `block`
    entries, then inside its block. torch.multinomial draws one exponential per
    vocabulary entry instead (B x V random numbers a token, a large share of a small
    model's decode step on CPU), and one float64 cumsum over all V would write twice the
    rows' bytes: the blocks read them once. Exact: an entry
    of probability 0 spans no interval of either CDF, so it is never drawn (each uniform
    stays below its CDF's total). Rows need not sum to 1; a row that is not finite or
    has no mass is an error, as with torch.multinomial. streams: [(torch.Generator, n)]
    covering the rows in order, each generator drawing the uniforms of its n rows as the
    global RNG would for an n-row batch alone (the rollout server's merged requests: each
    samples what it would alone, seeded the same, whatever else is in the batch)."""
    B, V = probs.shape
    sums = _block_sums(probs, block)  # (B, K) float64
    cdf = sums.cumsum(dim=-1)
    total = cdf[:, -1:]  # (B, 1)
    if not bool((torch.isfinite(total) & (total > 0)).all()):
        raise ValueError("sampling probabilities are not finite or sum to 0 (NaN/inf logits?)")
    u = _below(_uniforms(total.shape, cdf.dtype, probs.device, streams) * total, total)
    k = torch.searchsorted(cdf, u, right=True)  # (B, 1): a block with mass
    before = torch.where(k > 0, cdf.gather(1, (k - 1).clamp(min=0)), 0.0)
    idx = k * block + torch.arange(block, device=probs.device)  # (B, block)
    inside = probs.gather(1, idx.clamp(max=V - 1)).masked_fill(idx >= V, 0.0)
    inner = inside.cumsum(dim=-1, dtype=torch.float64)
    j = torch.searchsorted(inner, _below((u - before).clamp(min=0.0), inner[:, -1:]), right=True)
    return idx.gather(1, j).squeeze(1)


def _uniforms(
    shape: torch.Size, dtype: torch.dtype, device: torch.device, streams: Streams | None
) -> torch.Tensor:
    """(B, 1) uniforms in [0, 1): from the global RNG, or each stream's n from its own."""
    if streams is None:
        return torch.rand(shape, dtype=dtype, device=device)
    draws = [torch.rand((n, 1), dtype=dtype, device=device, generator=g) for g, n in streams]
    return torch.cat(draws).reshape(shape)


def _block_sums(probs: torch.Tensor, block: int) -> torch.Tensor:
    """(B, ceil(V / block)) sums of consecutive entries, the last block possibly short:
    summed in the rows' dtype (a float64 sum would first copy all of them to float64;
    a block's sum is then off by rounding only), returned in float64 for the cumsum over
    blocks, where the last blocks' masses must not vanish against the total."""
    B, V = probs.shape
    full = V - V % block
    sums = probs[:, :full].reshape(B, -1, block).sum(-1)
    if full < V:
        sums = torch.cat([sums, probs[:, full:].sum(-1, keepdim=True)], dim=1)
    return sums.double()


def _below(u: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """u capped at the largest float below `total`: searchsorted(cdf, u, right=True) then
    lands on an entry of mass, never past the last one."""
    return torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))


def truncates(top_k: int, top_p: float, vocab: int) -> bool:
    """Whether `truncate_logits` drops any token of a `vocab`-wide distribution."""
    return 0 < top_k < vocab or top_p < 1.0


def truncate_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Logits (B, V) with tokens outside the top-k and the nucleus set to -inf.

    top_k = 0 and top_p = 1.0 turn each off. The nucleus (Holtzman et al. 2020) is the
    smallest set of most likely tokens whose probability reaches top_p: a token stays
    while the tokens ranked above it hold less than top_p, so the most likely one always
    stays. Tokens tied with the k-th largest logit stay too.
    """
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ranked, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(ranked, dim=-1)
        mass_above = torch.cumsum(probs, dim=-1) - probs
        drop = torch.zeros_like(mass_above, dtype=torch.bool)
        drop.scatter_(-1, order, mass_above >= top_p)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits
