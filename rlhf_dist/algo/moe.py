"""The load-balancing loss of mixture-of-experts routers (Switch Transformer, Fedus et
al. 2021, eq. 4-6; Mixtral and Qwen-MoE use the same term), split so that its expert
token fractions can be counted over a whole global batch first (Qiu et al. 2025,
"Demons in the detail": global-batch load balancing).

For one MoE layer with E experts and top-k routing over N real tokens:
    f_i = (tokens with expert i among their top k) / N      (sum_i f_i = k)
    P_i = (sum over tokens of softmax(router logits)_i) / N
    loss = E * sum_i f_i * P_i                               (k when balanced)
and the model's loss is the mean over its L MoE layers. f is a count (no gradient); the
gradient flows through P alone, so a micro-batch's share of the loss is
E / L * sum_{l,i} f_{l,i} * (its own probability sums)_{l,i} / N with f and N of the
WHOLE global batch: the shares of all micro-batches and ranks add up to the global loss.
"""

from __future__ import annotations

import torch


def expert_counts(
    router_logits: torch.Tensor, top_k: int, token_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Tokens routed to each expert, (E,) float64: how many real tokens have expert i among
    their top_k router choices.

    router_logits: (N, E) one layer's logits; token_mask: (N,) 1 on real tokens (None: all).
    """
    chosen = torch.topk(router_logits.detach(), top_k, dim=-1).indices  # (N, k)
    weight = torch.ones(chosen.shape, dtype=torch.float64, device=chosen.device)
    if token_mask is not None:
        weight = weight * token_mask.reshape(-1, 1).to(torch.float64)
    counts = torch.zeros(router_logits.shape[-1], dtype=torch.float64, device=chosen.device)
    return counts.scatter_add(0, chosen.reshape(-1), weight.reshape(-1))


def router_prob_sums(
    router_logits: torch.Tensor, token_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Sum over real tokens of each expert's router probability, (E,) float32, with
    gradient. router_logits: (N, E); token_mask: (N,) 1 on real tokens (None: all)."""
    probs = torch.softmax(router_logits.float(), dim=-1)  # (N, E)
    if token_mask is not None:
        probs = probs * token_mask.reshape(-1, 1).to(probs.dtype)
    return probs.sum(0)


def load_balancing_sum(prob_sums: torch.Tensor, fractions: torch.Tensor) -> torch.Tensor:
    """A micro-batch's share of the load-balancing loss, times the global token count N:
    E / L * sum_{l,i} fractions_{l,i} * prob_sums_{l,i}, a 0-dim tensor. Divided by N it is
    the share; the shares of every micro-batch and rank add up to the global loss.

    prob_sums: (L, E) this micro-batch's `router_prob_sums` of each MoE layer;
    fractions: (L, E) f of the global batch (`expert_counts` summed over micro-batches and
    ranks, / N), a constant: no gradient flows through it.
    """
    layers, experts = prob_sums.shape
    f = fractions.detach().to(prob_sums.dtype)
    return (f * prob_sums).sum() * (experts / layers)


def load_balancing_loss(
    router_logits: list[torch.Tensor], top_k: int, token_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The whole batch's loss, mean over layers of E * sum_i f_i P_i (module docstring), 0-dim.
    router_logits: one (N, E) tensor per MoE layer; token_mask: (N,) 1 on real tokens."""
    counts = torch.stack([expert_counts(x, top_k, token_mask) for x in router_logits])
    sums = torch.stack([router_prob_sums(x, token_mask) for x in router_logits])
    n = token_mask.sum() if token_mask is not None else router_logits[0].shape[0]
    return load_balancing_sum(sums, counts / n) / n
