"""Token log-probabilities and entropies from logits, at a sampling temperature."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def scale_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits / temperature in float32 (float64 stays float64); same shape (..., V).

    The ONE place the project applies the sampling temperature: the old, new AND
    reference log-probs must all see it, or the ratio and the KL are off from step 0
    (N+ study). Upcast before dividing: a bf16 quotient would be rounded to ~3
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
    return x if x.dtype in (torch.float32, torch.float64) else x.float()
