"""On-policy distillation: the student samples, a frozen teacher scores the samples, and a
divergence between the two on the student's own tokens is the learning signal
(docs/distill.md).

Two signals, both row-local (a row's values depend on that row alone, so the trainer's
split-invariant aggregation applies unchanged):

- `distill_advantages`: the teacher's per-token log-ratio on the SAMPLED tokens, used as a
  per-token advantage in the importance-sampled policy-gradient loss, with no discounting
  (Thinking Machines, "On-Policy Distillation", 2025; the Qwen3 technical report's
  on-policy distillation). Its expectation over the student's samples is minus the
  per-token reverse KL, so the policy gradient descends KL(student || teacher).
- `generalized_jsd`: GKD's generalised Jensen-Shannon divergence over the WHOLE
  vocabulary at each sampled position (Agarwal et al. 2024, "On-Policy Distillation of
  Language Models", eq. in section 3.1), a differentiable loss term.

Shapes: B sequences, T response tokens, N scored positions, V vocabulary.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from rlhf_dist.algo.logprobs import scale_logits


def distill_advantages(
    old_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """Per-token distillation advantage A_t = log pi_T(y_t) - log pi_old(y_t), (B, T).

    The negative of the k1 estimate of the per-token reverse KL, KL(pi_old || pi_T), at the
    token y_t the student sampled (Thinking Machines 2025: "the per-token reverse KL as the
    advantage", discount factor 0: each token is credited with its own log-ratio only).
    Positive where the teacher likes the sampled token more than the student did, so the
    policy-gradient step raises it. old_logprobs, teacher_logprobs: (B, T) at the sampling
    temperature; response_mask: (B, T) bool. 0 outside the mask; in old_logprobs' dtype.
    """
    zero = torch.zeros((), dtype=old_logprobs.dtype, device=old_logprobs.device)
    diff = teacher_logprobs.to(old_logprobs.dtype) - old_logprobs
    return torch.where(response_mask.bool(), diff, zero)


def _kl_terms(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """KL(p || q) = sum_v p_v (log p_v - log q_v) over the last dimension, (..., V) -> (...).
    Terms where p_v underflows to 0 add 0 (log-probs of finite logits are finite)."""
    return (logp.exp() * (logp - logq)).sum(-1)


def generalized_jsd(
    logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float, temperature: float = 1.0
) -> torch.Tensor:
    """GKD's generalised JSD between teacher P and student Q at each position, (N,).

    JSD(beta)(P || Q) = beta KL(P || M) + (1 - beta) KL(Q || M), M = beta P + (1 - beta) Q
    (Agarwal et al. 2024, section 3.1), with P = softmax(teacher_logits / temperature) and
    Q = softmax(logits / temperature), the student's. JSD(beta) -> 0 at both ends, and
    JSD(beta) / beta -> KL(P || Q) (forward KL) as beta -> 0, JSD(beta) / (1 - beta) ->
    KL(Q || P) (reverse KL) as beta -> 1; so beta = 0 is defined as the forward KL and
    beta = 1 as the reverse KL (the GKD paper's and TRL's convention: the gradient of
    JSD(beta) near the ends behaves like theirs). 0 < beta < 1 is JSD(beta) itself.

    logits, teacher_logits: (N, V) finite, over the same vocabulary; gradients flow to
    whichever requires them (the trainer gives the teacher's without). Returns (N,) >= 0 in
    float32 (float64 for float64 logits). Memory: a few (N, V) tensors: the caller chunks N.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    logq = F.log_softmax(scale_logits(logits, temperature), dim=-1)
    logp = F.log_softmax(scale_logits(teacher_logits, temperature), dim=-1).to(logq.dtype)
    if beta == 0.0:
        return _kl_terms(logp, logq)
    if beta == 1.0:
        return _kl_terms(logq, logp)
    # log M = logsumexp(log beta + log P, log(1 - beta) + log Q): stable, no (N, V) exp/log
    logm = torch.logaddexp(logp + math.log(beta), logq + math.log1p(-beta))
    return beta * _kl_terms(logp, logm) + (1.0 - beta) * _kl_terms(logq, logm)
