"""Offline preference losses: DPO (sigmoid, label-smoothed "conservative" DPO), IPO, KTO, and
the reference-free SimPO and ORPO.

No sampling and no reward model: the policy is trained directly on labelled responses,
against a frozen reference policy (DPO, IPO, KTO) or against nothing but itself (SimPO,
ORPO). Everything here works on per-SEQUENCE log-probability sums, log pi(y | x) = sum_t
log pi(y_t | x, y_<t) over the response tokens only (`sequence_logprobs`, with the one mask
polarity `response_mask`, True on response tokens), and for SimPO/ORPO on the response
lengths |y| that turn them into per-token means.

Implicit reward of a response (Rafailov et al. 2023, section 5): r(x, y) = beta *
(log pi(y|x) - log pi_ref(y|x)); SimPO's is length-normalised and reference-free, beta / |y|
* log pi(y|x). The `*_terms` functions return per-example losses, unreduced, for trainers
that divide sums by the example count of a whole global batch (split invariance,
docs/architecture.md section 4); `dpo_loss`, `simpo_loss`, `orpo_loss` and `kto_loss` are
the per-call means.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from rlhf_dist.algo.catalog import DPO_LOSS_TYPES
from rlhf_dist.algo.masking import masked_sum

__all__ = ["DPO_LOSS_TYPES"]  # re-exported: the dpo.loss_type names (algo/catalog.py)


def sequence_logprobs(logprobs: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """log pi(y | x) of each sequence: per-token log-probs summed over response tokens.

    logprobs: (B, T) from `logprobs_from_logits`; response_mask: (B, T) bool, True on response
    tokens. Returns (B,). Padding is excluded with `where`, so garbage there cannot leak in.
    """
    return masked_sum(logprobs, response_mask, dim=1)


def logistic_loss(z: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Bradley-Terry negative log-likelihood of "chosen beats rejected" at logit z, (B,) -> (B,).

    -log sigmoid(z); with label_smoothing eps (the label is wrong with probability eps;
    Mitchell 2023, "A note on DPO with noisy preferences") the binary cross-entropy against
    1 - eps: -(1 - eps) log sigmoid(z) - eps log sigmoid(-z). logsigmoid, not
    log(sigmoid(z)): finite for any z.
    """
    loss = -(1.0 - label_smoothing) * F.logsigmoid(z)
    if label_smoothing:
        loss = loss - label_smoothing * F.logsigmoid(-z)
    return loss


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
        loss = logistic_loss(beta * h, label_smoothing)
    elif loss_type == "ipo":
        loss = (h - 1.0 / (2.0 * beta)) ** 2
    else:  # simpo and orpo have no reference: simpo_terms, orpo_terms
        raise ValueError(f"loss_type must be sigmoid or ipo here, got {loss_type!r}")
    return {
        "loss": loss,
        "chosen_rewards": beta * chosen_logratio.detach(),
        "rejected_rewards": beta * rejected_logratio.detach(),
    }


def best_worst_pairs(
    scores: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Online DPO's pairs (Guo et al. 2024, section 3; with n > 2 samples the best against
    the worst, as Xu et al. 2024 "Is DPO superior to PPO" and TRL pick them): per group of
    `group_size` contiguous rows, the best-scored row is chosen and the worst rejected.

    scores: (B,), B = G x group_size, a prompt's samples in adjacent rows. Returns (chosen,
    rejected, valid), each (G,): row indices into the B rows (long), and whether the group
    has a pair at all. A group whose best and worst scores are equal (a tie; with a NaN
    score too, since NaN compares unequal to nothing) has no preference: valid is False
    there, and its indices are the group's first row. Among equal best (worst) scores the
    first row is taken, so the result depends on the scores only."""
    B = scores.shape[0]
    if group_size < 2 or B % group_size:
        raise ValueError(f"best_worst_pairs: {B} rows do not form groups of {group_size} >= 2")
    grouped = scores.reshape(-1, group_size)
    best, worst = grouped.max(dim=1), grouped.min(dim=1)
    valid = best.values > worst.values
    # torch's argmax/argmin of a row: its FIRST extreme value (documented), on any device
    chosen, rejected = grouped.argmax(dim=1), grouped.argmin(dim=1)
    start = torch.arange(grouped.shape[0], device=scores.device) * group_size
    chosen = torch.where(valid, start + chosen, start)
    rejected = torch.where(valid, start + rejected, start)
    return chosen, rejected, valid


def pair_labels(scores: torch.Tensor, group_size: int, response_mask: torch.Tensor) -> torch.Tensor:
    """Online DPO's per-token pair labels (B, T) in the scores' dtype: +1 on every token of
    each group's chosen (best) row, -1 on the rejected (worst) row's, 0 on the other rows,
    on tied groups and off the mask (best_worst_pairs). Not an advantage: the DPO update
    trains on the pairs themselves; these are what the rollout statistics and histograms
    show. scores: (B,); response_mask: (B, T) bool."""
    chosen, rejected, valid = best_worst_pairs(scores, group_size)
    label = torch.zeros(scores.shape[0], dtype=scores.dtype, device=scores.device)
    label[chosen[valid]] = 1.0
    label[rejected[valid]] = -1.0
    return torch.where(response_mask.bool(), label[:, None], 0.0)


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

    Returns (loss, stats), all 0-dim: `pair_stats` of the implicit rewards.
    """
    terms = dpo_terms(
        policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta, loss_type, label_smoothing
    )
    return terms["loss"].mean(), pair_stats(terms["chosen_rewards"], terms["rejected_rewards"])


def pair_stats(chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, torch.Tensor]:
    """Means over B pairs of the rewards chosen, rejected (B,): 0-dim `chosen_rewards`,
    `rejected_rewards`, `margins` (their difference) and `accuracy` (share of pairs whose
    chosen reward is strictly larger; a tie counts as wrong)."""
    return {
        "chosen_rewards": chosen.mean(),
        "rejected_rewards": rejected.mean(),
        "margins": (chosen - rejected).mean(),
        "accuracy": (chosen > rejected).to(chosen.dtype).mean(),
    }


def mean_logprobs(logprob_sums: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Per-token mean log-prob of each response, log pi(y|x) / |y|; both inputs and output (B,).

    lengths: response token counts (the response_mask's row sums), clamped at 1 so that an
    empty response (sum 0) gives 0, not NaN.
    """
    return logprob_sums / lengths.to(logprob_sums.dtype).clamp(min=1)


def simpo_terms(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    chosen_lengths: torch.Tensor,
    rejected_lengths: torch.Tensor,
    beta: float,
    margin: float,
    label_smoothing: float = 0.0,
) -> dict[str, torch.Tensor]:
    """Per-pair SimPO loss (Meng et al. 2024, eq. 6) and its rewards; every input and output (B,).

    policy_*: sequence log-prob sums; *_lengths: response token counts. The implicit reward
    is reference-free and length-normalised, r(x, y) = beta / |y| * log pi(y|x) (eq. 4), and
    the loss asks the chosen reward to beat the rejected one by `margin` (the paper's gamma,
    dpo.simpo_gamma): -log sigmoid(r_w - r_l - margin), with label_smoothing eps the
    cross-entropy against 1 - eps (`logistic_loss`, as TRL's CPOTrainer smooths it).
    Returns `loss`, and `chosen_rewards` / `rejected_rewards` = r (detached).
    """
    chosen = beta * mean_logprobs(policy_chosen, chosen_lengths)
    rejected = beta * mean_logprobs(policy_rejected, rejected_lengths)
    return {
        "loss": logistic_loss(chosen - rejected - margin, label_smoothing),
        "chosen_rewards": chosen.detach(),
        "rejected_rewards": rejected.detach(),
    }


def simpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    chosen_lengths: torch.Tensor,
    rejected_lengths: torch.Tensor,
    beta: float,
    margin: float,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean of `simpo_terms` over the B pairs; inputs (B,). Returns (loss, `pair_stats`)."""
    terms = simpo_terms(
        policy_chosen,
        policy_rejected,
        chosen_lengths,
        rejected_lengths,
        beta,
        margin,
        label_smoothing,
    )
    return terms["loss"].mean(), pair_stats(terms["chosen_rewards"], terms["rejected_rewards"])


def log_odds(mean_logprob: torch.Tensor) -> torch.Tensor:
    """log odds(y|x) = log p - log(1 - p) for log p = mean_logprob (B,) <= 0; returns (B,).

    ORPO's p is the per-token mean probability exp(mean log-prob) (Hong et al. 2024, eq. 4).
    log(1 - e^x) is computed without cancellation: log(-expm1(x)) for x > -log 2, log1p(-e^x)
    below (Maechler 2012, "Accurately computing log(1 - exp(-|a|))"). x is clamped at the
    dtype's smallest normal below 0 so that p = 1 (x rounds to 0) gives a large finite log
    odds, not inf; there the clamp's gradient is 0, where the exact one would be infinite.
    """
    x, cut = mean_logprob.clamp(max=-torch.finfo(mean_logprob.dtype).tiny), -math.log(2.0)
    # Each branch sees only inputs it is exact and finite on: the branch torch.where drops
    # must not produce an inf, whose gradient times where's 0 would be NaN.
    near = torch.log(-torch.expm1(x.clamp(min=cut)))
    far = torch.log1p(-torch.exp(x.clamp(max=cut)))
    return x - torch.where(x > cut, near, far)


def orpo_terms(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    chosen_lengths: torch.Tensor,
    rejected_lengths: torch.Tensor,
    or_weight: float,
) -> dict[str, torch.Tensor]:
    """Per-pair odds-ratio term of ORPO (Hong et al. 2024, eq. 6-7); every input and output (B,).

    policy_*: sequence log-prob sums; *_lengths: response token counts. With p the per-token
    mean probability of a response and odds = p / (1 - p), the term is or_weight * L_OR,
    L_OR = -log sigmoid(log(odds_w / odds_l)) (eq. 7; or_weight is the paper's lambda,
    dpo.beta as TRL's beta). ORPO's whole loss adds the chosen responses' NLL (eq. 6), a
    token mean that trainers divide by the global token count (`orpo_loss` shows the sum).
    Returns `loss` (or_weight * L_OR), `log_odds_ratio` = log(odds_w / odds_l), and
    `chosen_rewards` / `rejected_rewards` = or_weight * mean log-prob (TRL's ORPOTrainer's
    logged rewards), all but `loss` detached.
    """
    chosen = mean_logprobs(policy_chosen, chosen_lengths)
    rejected = mean_logprobs(policy_rejected, rejected_lengths)
    ratio = log_odds(chosen) - log_odds(rejected)
    return {
        "loss": -or_weight * F.logsigmoid(ratio),
        "log_odds_ratio": ratio.detach(),
        "chosen_rewards": or_weight * chosen.detach(),
        "rejected_rewards": or_weight * rejected.detach(),
    }


def orpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    chosen_lengths: torch.Tensor,
    rejected_lengths: torch.Tensor,
    or_weight: float,
    nll_sum: torch.Tensor,
    nll_tokens: torch.Tensor | int,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ORPO's loss of one batch of B pairs: NLL + or_weight * mean L_OR (Hong et al. 2024, eq. 6).

    Inputs (B,) as `orpo_terms`; nll_sum: 0-dim sum of -log pi over the chosen sequences'
    NLL tokens (their response tokens, or prompt and response as ORPO's authors' code and
    TRL's ORPOTrainer take them), nll_tokens: how many tokens that sums, so the NLL is their
    token mean. Returns (loss, stats), 0-dim: `pair_stats` of the rewards, `nll` and
    `log_odds_ratio` (mean).
    """
    terms = orpo_terms(policy_chosen, policy_rejected, chosen_lengths, rejected_lengths, or_weight)
    nll = nll_sum / nll_tokens
    stats = pair_stats(terms["chosen_rewards"], terms["rejected_rewards"])
    stats |= {"nll": nll.detach(), "log_odds_ratio": terms["log_odds_ratio"].mean()}
    return nll + terms["loss"].mean(), stats


def kto_reference_point(logratio_sum: torch.Tensor, count: torch.Tensor | int) -> torch.Tensor:
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
