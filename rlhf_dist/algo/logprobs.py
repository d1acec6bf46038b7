"""Token log-probabilities and entropies from logits, at a sampling temperature."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def scale_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits / temperature in float32 (float64 stays float64); same shape (..., V).

    The ONE place the project applies the sampling temperature: the old, new AND
    reference log-probs must all see it, or the ratio and the KL are off from step 0.
    Upcast before dividing: a bf16 quotient would be rounded to ~3
    significant digits again, and log_softmax's normaliser needs float32 anyway. At
    temperature 1 float32 logits come back as they are (no copy of a (B, T, V) tensor),
    so do not edit the result in place.
    """
    logits = _at_least_float32(logits)
    return logits if temperature == 1.0 else logits / temperature


def logprobs_from_logits(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log softmax(logits / temperature) gathered at `tokens`.

    logits: (B, T, V); tokens: (B, T) int64. Returns (B, T) float32 (float64 for float64
    logits).
    """
    # log_softmax over V then gather: exact and numerically stable.
    logp = F.log_softmax(scale_logits(logits, temperature), dim=-1)
    return _gather(logp, tokens)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy -sum_v p_v log p_v of the categorical given by `logits`.

    logits: (B, T, V). Returns (B, T), >= 0.
    """
    return _entropy(F.log_softmax(_at_least_float32(logits), dim=-1))


def logprobs_and_entropy(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs_from_logits, entropy of softmax(logits / temperature)), each (B, T).

    logits: (B, T, V); tokens: (B, T). One log_softmax serves both: the entropy PPO logs
    is that of the distribution the responses were sampled from (same temperature).
    """
    logp = F.log_softmax(scale_logits(logits, temperature), dim=-1)
    return _gather(logp, tokens), _entropy(logp)


def _gather(logp: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """logp (B, T, V) at tokens (B, T) -> (B, T)."""
    return logp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


def _entropy(logp: torch.Tensor) -> torch.Tensor:
    """-sum_v p_v log p_v of log-probabilities logp (B, T, V) -> (B, T)."""
    # Written via log p, not logsumexp(z) - sum_v p_v z_v: stays finite for -inf logits.
    p = logp.exp()
    return -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(-1)


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """x in float32 unless it is float32 or float64 already; same shape."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def logprobs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`logprobs_and_entropy` of the logits hidden @ weight.T + bias, without the (N, V)
    logits of all tokens ever existing.

    hidden: (N, H) final hidden states, one row per predicted token; weight: (V, H) the
    output head (a tied embedding alike); bias: (V,) or None; tokens: (N,) int64 targets.
    Returns logprobs (N,) and, with `with_entropy`, the entropy (N,) of softmax(logits /
    temperature); float32 (float64 for float64 weights). The head runs over chunks of
    `chunk_tokens` rows inside one autograd Function that recomputes each chunk's logits in
    backward, so the extra memory is a few (chunk_tokens, V) tensors in both directions
    (the whole-logits path keeps several (N, V) fp32 tensors: logits, log_softmax,
    softmax and their gradients). Gradients flow to hidden, weight and bias from both outputs. The
    head is computed in the autocast dtype when autocast is on for hidden's device, else
    in weight's dtype (as the model's own head would), then upcast as `scale_logits` does.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    device = hidden.device.type
    autocast = torch.is_autocast_enabled(device)
    dtype = torch.get_autocast_dtype(device) if autocast else weight.dtype
    logprobs, entropy = _ChunkedHeadLogprobs.apply(
        hidden,
        weight,
        bias,
        tokens.long(),
        float(temperature),
        int(chunk_tokens),
        bool(with_entropy),
        dtype,
    )
    return logprobs, (entropy if with_entropy else None)


def _chunk_logp(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float,
    work: torch.Tensor,
) -> torch.Tensor:
    """log_softmax(scale_logits(hidden @ weight.T + bias)) of one chunk, (C, H) -> (C, V),
    written into work[1] (work: (2, >= C, V), the call's workspace; work[0] is scratch);
    weight (V, H) and bias (V,) already in the compute dtype. The same kernels as F.linear and
    F.log_softmax (mm, or addmm with a bias), so the same bits."""
    rows = hidden.shape[0]
    logits, logp = work[0, :rows], work[1, :rows]
    hidden = hidden.to(weight.dtype)
    if weight.dtype != work.dtype:  # a bf16/fp16 head: its logits, then upcast
        logits.copy_(F.linear(hidden, weight, bias))
    elif bias is None:
        torch.mm(hidden, weight.t(), out=logits)
    else:
        torch.addmm(bias, hidden, weight.t(), out=logits)
    if temperature != 1.0:
        logits.div_(temperature)
    return torch.log_softmax(logits, dim=-1, out=logp)


def _workspace(rows: int, chunk: int, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(2, min(rows, chunk), V) float32 (float64 for float64) buffers that every chunk of
    one forward or backward reuses; weight: (V, H). Fresh (C, V) tensors per op are each
    a large allocation that the allocator maps and unmaps (page faults, TLB shootdowns):
    one reused workspace is both faster and a lower peak (docs/benchmarks.md)."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    return torch.empty((2, min(rows, chunk), weight.shape[0]), dtype=acc, device=weight.device)


def _entropy_into(logp: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """`_entropy` of logp (C, V) -> (C,), using scratch (C, V) for p and CONSUMING logp.
    Where p underflows to 0, `_entropy` takes p log p as 0; here log p is clamped to the
    dtype's lowest finite value first, so 0 * log p is 0 (never 0 * -inf = nan) and every
    other term is the same product: the same sum."""
    p = torch.exp(logp, out=scratch)
    return -p.mul_(_finite_(logp)).sum(-1)


def _finite_(logp: torch.Tensor) -> torch.Tensor:
    """logp (C, V) clamped in place to its dtype's lowest finite value: -inf (a masked entry)
    becomes finite, so p * logp is 0 where p == 0; every entry with p > 0 is unchanged."""
    return logp.clamp_(min=torch.finfo(logp.dtype).min)


def _cast(
    weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The head, weight (V, H) and bias (V,) or None, in the compute dtype, cast once per
    pass (not once per chunk)."""
    return weight.to(dtype), None if bias is None else bias.to(dtype)


class _ChunkedHeadLogprobs(torch.autograd.Function):
    """Forward: per chunk of rows, logits -> log_softmax -> gather (and entropy); keeps only
    the (N,) results. Backward: per chunk, the logits again and, with z = logits / tau,
    p = softmax(z) and H the entropy,
        d logprob / dz = onehot(token) - p,      d H / dz = -p * (log p + H),
    so dL/dz = g_lp * (onehot - p) - g_H * p * (log p + H); dL/dlogits = dL/dz / tau,
    then dL/dhidden = dL/dlogits @ W, dL/dW = sum_chunks dL/dlogits^T @ hidden (fp32)."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        tokens: torch.Tensor,
        temperature: float,
        chunk: int,
        with_entropy: bool,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden (N, H), weight (V, H), bias (V,) or None, tokens (N,) -> logprobs (N,)
        and entropy (N,) (zeros without `with_entropy`)."""
        n = hidden.shape[0]
        out_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        logprobs = torch.empty(n, dtype=out_dtype, device=hidden.device)
        entropy = torch.zeros(n, dtype=out_dtype, device=hidden.device)
        w, b = _cast(weight, bias, dtype)
        work = _workspace(n, chunk, weight, dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, n, chunk):
                rows = slice(start, start + chunk)
                logp = _chunk_logp(hidden[rows], w, b, temperature, work)
                logprobs[rows] = _gather(logp, tokens[rows])
                if with_entropy:
                    entropy[rows] = _entropy_into(logp, work[0, : logp.shape[0]])
        ctx.save_for_backward(hidden, weight, bias, tokens, entropy)
        ctx.config = (temperature, chunk, with_entropy, dtype)
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(
        ctx: Any, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        """The (N,) output gradients (None where not materialised) -> gradients of hidden
        (N, H), weight (V, H) and bias (V,), None for the other inputs."""
        hidden, weight, bias, tokens, entropy = ctx.saved_tensors
        temperature, chunk, with_entropy, dtype = ctx.config
        if not with_entropy:
            grad_entropy = None
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros_like(hidden) if needs_hidden else None
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        grad_weight = (
            torch.zeros(weight.shape, dtype=acc, device=weight.device) if needs_weight else None
        )
        grad_bias = torch.zeros(bias.shape, dtype=acc, device=bias.device) if needs_bias else None
        if grad_logprobs is None and grad_entropy is None:
            return grad_hidden, _as(grad_weight, weight), _as(grad_bias, bias), *(None,) * 5
        w, b = _cast(weight, bias, dtype)
        work = _workspace(hidden.shape[0], chunk, weight, dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], chunk):
                rows = slice(start, start + chunk)
                grad_logits = _chunk_grad_logits(
                    hidden[rows],
                    w,
                    b,
                    tokens[rows],
                    entropy[rows],
                    _part(grad_logprobs, rows),
                    _part(grad_entropy, rows),
                    temperature,
                    work,
                )
                if grad_hidden is not None:  # needs_hidden
                    grad_hidden[rows] = (grad_logits.to(dtype) @ w).to(hidden.dtype)
                if grad_weight is not None:  # needs_weight
                    grad_weight.addmm_(grad_logits.t(), hidden[rows].to(acc))
                if grad_bias is not None:  # needs_bias
                    grad_bias += grad_logits.sum(0)
        return grad_hidden, _as(grad_weight, weight), _as(grad_bias, bias), *(None,) * 5


def _chunk_grad_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tokens: torch.Tensor,
    entropy: torch.Tensor,
    grad_lp: torch.Tensor | None,
    grad_h: torch.Tensor | None,
    temperature: float,
    work: torch.Tensor,
) -> torch.Tensor:
    """dL/dlogits (C, V) of one chunk, hidden (C, H), tokens and entropy (C,), from the
    (C,) output gradients (either may be None; not both), a view of the workspace `work` (2, >= C, V), valid until the next chunk.
    The 1/temperature of dz/dlogits is folded into the (C,) gradients."""
    logp = _chunk_logp(hidden, weight, bias, temperature, work)  # work[1]
    p = torch.exp(logp, out=work[0, : logp.shape[0]])
    grad = None
    if grad_h is not None:
        # -g_H * p * (log p + H) in logp's buffer; where p == 0 the product is 0 because
        # log p is made finite first, as `_entropy` takes p log p = 0 there
        scale = (-grad_h / temperature).unsqueeze(-1)
        grad = _finite_(logp).add_(entropy.unsqueeze(-1)).mul_(p).mul_(scale)
    if grad_lp is not None:
        g = (grad_lp / temperature).unsqueeze(-1)
        term = p.mul_(-g)  # g_lp * (onehot - p): p is not needed after this
        grad = term if grad is None else grad.add_(term)
        grad.scatter_add_(-1, tokens.unsqueeze(-1), g.to(grad.dtype))
    return grad


def _part(grad: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    """The rows of an (N,) gradient, None where the gradient is."""
    return None if grad is None else grad[rows]


def _as(grad: torch.Tensor | None, like: torch.Tensor | None) -> torch.Tensor | None:
    """A float32/float64 accumulated gradient in its input's dtype, same shape."""
    if grad is None:
        return None
    assert like is not None, "a gradient is computed only for a tensor that was given"
    return grad.to(like.dtype)
