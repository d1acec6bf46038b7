"""Offline preference losses: DPO (sigmoid, label-smoothed "conservative" DPO), IPO and KTO.

No sampling and no reward model: the policy is trained directly on labelled responses
against a frozen reference policy. Everything here works on per-SEQUENCE log-probability
sums, log pi(y | x) = sum_t log pi(y_t | x, y_<t) over the response tokens only
(`sequence_logprobs`, with the one mask polarity `response_mask`, True on response tokens).

Implicit reward of a response (Rafailov et al. 2023, section 5): r(x, y) = beta *
(log pi(y|x) - log pi_ref(y|x)). The `*_terms` functions return per-example losses, unreduced,
for trainers that divide sums by the example count of a whole global batch (split invariance,
docs/architecture.md section 4); `dpo_loss` and `kto_loss` are the per-call means.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlhf_dist.algo.masking import masked_sum

DPO_LOSS_TYPES = ("sigmoid", "ipo")


def sequence_logprobs(logprobs: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """log pi(y | x) of each sequence: per-token log-probs summed over response tokens.

    logprobs: (B, T) from `logprobs_from_logits`; response_mask: (B, T) bool, True on response
    tokens. Returns (B,). Padding is excluded with `where`, so garbage there cannot leak in.
    """
    return masked_sum(logprobs, response_mask, dim=1)


def dpo_terms(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> dict[str, torch.Tensor]:
    """Per-pair DPO / cDPO / IPO loss and the implicit rewards; every input and output (B,).

    The four inputs are sequence log-prob sums. With h = (log pi(y_w) - log pi_ref(y_w))
    - (log pi(y_l) - log pi_ref(y_l)), the log-ratio margin of chosen y_w over rejected y_l:
    - sigmoid: -log sigmoid(beta * h) (Rafailov et al. 2023, eq. 7). With label_smoothing
      eps (conservative DPO: the label is wrong with probability eps; Mitchell 2023, "A note
      on DPO with noisy preferences") the binary cross-entropy against 1 - eps:
      -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h).
    - ipo: (h - 1 / (2 beta))^2 (Azar et al. 2023, eq. 17, with tau = beta): regresses the
      margin onto a finite target instead of pushing it to infinity.
    Returns `loss`, and `chosen_rewards` / `rejected_rewards` = beta * log-ratio (detached).
    """
    chosen_logratio = policy_chosen - ref_chosen
    rejected_logratio = policy_rejected - ref_rejected
    h = chosen_logratio - rejected_logratio
    if loss_type == "sigmoid":
        # logsigmoid, not log(sigmoid(x)): finite for any margin.
        loss = -(1.0 - label_smoothing) * F.logsigmoid(beta * h)
        if label_smoothing:
            loss = loss - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        loss = (h - 1.0 / (2.0 * beta)) ** 2
    else:
        raise ValueError(f"loss_type must be one of {DPO_LOSS_TYPES}, got {loss_type!r}")
    return {
        "loss": loss,
        "chosen_rewards": beta * chosen_logratio.detach(),
        "rejected_rewards": beta * rejected_logratio.detach(),
    }


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean of `dpo_terms` over the pairs; inputs (B,).

    Returns (loss, stats), all 0-dim: stats `chosen_rewards`, `rejected_rewards`,
    `margins` (their difference) and `accuracy` (share of pairs whose chosen reward is
    strictly larger; a tie counts as wrong), all means over the B pairs.
    """
    terms = dpo_terms(
        policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta, loss_type, label_smoothing
    )
    chosen, rejected = terms["chosen_rewards"], terms["rejected_rewards"]
    stats = {
        "chosen_rewards": chosen.mean(),
        "rejected_rewards": rejected.mean(),
        "margins": (chosen - rejected).mean(),
        "accuracy": (chosen > rejected).to(chosen.dtype).mean(),
    }
    return terms["loss"].mean(), stats


def kto_reference_point(logratio_sum: torch.Tensor, count) -> torch.Tensor:
    """KTO's reference point z0 (Ethayarajh et al. 2024, section 4.1), 0-dim.

    z0 estimates KL(pi || pi_ref) as the mean of log pi(y'|x) - log pi_ref(y'|x) over
    MISMATCHED pairs (x, y'), a prompt with another example's completion. logratio_sum: the
    0-dim sum of those log-ratios over the batch (a trainer passes the sum over all ranks and
    micro-batches); count: how many pairs it sums. Clamped at 0 (a KL is never negative; the
    estimate can be) and detached: the paper does not backpropagate through z0.
    """
    return (logratio_sum.detach() / count).clamp(min=0.0)


def kto_terms(
    policy_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    desirable: torch.Tensor,
    reference_point: torch.Tensor,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> dict[str, torch.Tensor]:
    """Per-example KTO loss lambda_y - v(x, y) (Ethayarajh et al. 2024, section 4.1); (B,).

    policy_logprobs, ref_logprobs: (B,) sequence log-prob sums; desirable: (B,) bool label;
    reference_point: 0-dim z0 from `kto_reference_point`. With r = log pi - log pi_ref:
    v = lambda_D sigmoid(beta (r - z0)) for desirable examples and lambda_U sigmoid(beta (z0 - r))
    for undesirable ones (lambda_D = desirable_weight, lambda_U = undesirable_weight), so
    each loss lies in [0, lambda_y]. Returns `loss` and `rewards` = beta * r (detached).
    """
    logratio = policy_logprobs - ref_logprobs
    z0 = reference_point.detach()
    desirable = desirable.bool()
    signed = torch.where(desirable, logratio - z0, z0 - logratio)
    weight = torch.where(
        desirable,
        torch.full_like(logratio, desirable_weight),
        torch.full_like(logratio, undesirable_weight),
    )
    return {
        "loss": weight * (1.0 - torch.sigmoid(beta * signed)),
        "rewards": beta * logratio.detach(),
    }


def kto_loss(
    policy_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    desirable: torch.Tensor,
    kl_policy_logprobs: torch.Tensor,
    kl_ref_logprobs: torch.Tensor,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean KTO loss of one batch, z0 estimated from the batch's mismatched pairs.

    policy_logprobs, ref_logprobs, desirable: (B,) of the labelled examples; kl_policy_logprobs,
    kl_ref_logprobs: (K,) sequence log-prob sums of the K mismatched (prompt, completion) pairs.
    Returns (loss, stats), 0-dim: stats `kl` (z0), `desirable_rewards` and
    `undesirable_rewards` (mean implicit reward of each class; NaN if the batch has none).
    """
    z0 = kto_reference_point(
        (kl_policy_logprobs - kl_ref_logprobs).sum(), kl_policy_logprobs.numel()
    )
    terms = kto_terms(
        policy_logprobs, ref_logprobs, desirable, z0, beta, desirable_weight, undesirable_weight
    )
    rewards, desirable = terms["rewards"], desirable.bool()
    stats = {
        "kl": z0,
        "desirable_rewards": rewards[desirable].mean(),
        "undesirable_rewards": rewards[~desirable].mean(),
    }
    return terms["loss"].mean(), stats
