"""Token log-probabilities and entropies from logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def logprobs_from_logits(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log softmax(logits / temperature) gathered at `tokens`.

    logits: (B, T, V); tokens: (B, T) int64. Returns (B, T) in logits' dtype.
    The temperature must be the sampling temperature for old, new AND reference
    log-probs alike, or the ratio and the KL are off from step 0 (N+ study).
    """
    if temperature != 1.0:
        logits = logits / temperature
    # log_softmax over V then gather: exact and numerically stable. The upcast keeps bf16
    # logits from losing ~3 significant digits in the normaliser.
    logp = F.log_softmax(_at_least_float32(logits), dim=-1)
    return logp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1).to(logits.dtype)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy -sum_v p_v log p_v of the categorical given by `logits`.

    logits: (B, T, V). Returns (B, T), >= 0.
    """
    logp = F.log_softmax(_at_least_float32(logits), dim=-1)
    # H = logsumexp(z) - sum_v p_v z_v, written via log p to stay finite for -inf logits.
    p = logp.exp()
    return -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(-1)


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()
