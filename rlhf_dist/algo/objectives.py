"""The pieces of the 2025 verifiable-reward objectives: GSPO's sequence-level ratio and
DAPO's overlong handling and dynamic-sampling filter
(docs/algorithms.md, "objectives"; docs/agents.md, "Objectives"). CISPO's clipped
stop-gradient weight is the registered policy loss "cispo" (policy_losses.py).

Every per-token function is row-local (a row's values depend on that row alone), so the
trainer's split-invariant aggregation (`losses.aggregation_weights`, one global count per
optimizer step) applies to them unchanged. Shapes: B sequences, T response tokens, G
groups of n consecutive rows (the n samples of one prompt).
"""

from __future__ import annotations

import torch


def sequence_log_ratio(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """GSPO-token log-ratio (Zheng et al. 2025, "Group Sequence Policy Optimization", eqs.
    7 and 13), (B, T).

    GSPO's importance ratio is the length-normalised sequence ratio
    s_i = (pi(y_i|x) / pi_old(y_i|x))^(1/|y_i|) = exp(mean_t (logprobs - old_logprobs)),
    the mean over row i's response tokens. GSPO-token writes it per token as
    s_i,t = sg[s_i] * pi(y_i,t) / sg[pi(y_i,t)]: every token's VALUE is s_i, and its
    GRADIENT is s_i times the token's own log-prob gradient. This returns log s_i,t =
    sg[log s_i] + logprobs - sg[logprobs], for the policy losses' `log_ratio`.
    With one advantage per row and per-row token means (seq_mean_token_mean) the gradient
    is GSPO's sequence-level one. A row without response tokens gets 0. Positions outside
    the mask hold the row's value and carry no gradient of other tokens.
    logprobs, old_logprobs: (B, T); response_mask: (B, T) bool.
    """
    mask = response_mask.bool()
    diff = torch.where(mask, logprobs - old_logprobs, torch.zeros_like(logprobs))
    count = mask.sum(dim=1, keepdim=True).clamp(min=1).to(logprobs.dtype)
    per_row = (diff.sum(dim=1, keepdim=True) / count).detach()
    return per_row + logprobs - logprobs.detach()


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), added to the score; (B,).

    With L_max = max_length and L_cache = buffer: 0 for |y| <= L_max - L_cache;
    ((L_max - L_cache) - |y|) / L_cache inside the buffer (from 0 down to -1 at L_max);
    -1 beyond L_max. lengths: (B,) response lengths |y| (ints or floats); 0 < buffer <= max_length.
    """
    if not 0 < buffer <= max_length:
        raise ValueError(f"overlong buffer must be in (0, {max_length}], got {buffer}")
    y = lengths.to(torch.float32) if not lengths.is_floating_point() else lengths
    start = max_length - buffer
    inside = (start - y) / buffer
    penalty = torch.where(y <= max_length, inside, torch.full_like(y, -1.0))
    return torch.where(y <= start, torch.zeros_like(y), penalty)


def drop_truncated(response_mask: torch.Tensor, finished: torch.Tensor) -> torch.Tensor:
    """DAPO's overlong filtering (Yu et al. 2025, section 3.4): the loss mask without the
    truncated responses (no stop token within the length limit), (B, T) bool.

    response_mask: (B, T) bool; finished: (B,) bool, True where the response ended with a
    stop token. A truncated row keeps no True position: it adds nothing to any loss term
    or token count.
    """
    return response_mask.bool() & finished.bool()[:, None]


def tied_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """(G,) bool: True where all n scores of a group are equal (DAPO's dynamic sampling,
    Yu et al. 2025, eq. 11: a group whose accuracy is 0 or 1 everywhere).

    Such a group's scores have zero spread, so a group-baseline estimator (GRPO, RLOO,
    REINFORCE++-baseline) gives its samples no score signal. scores: (B,) with B = G x n,
    the n samples of group g in rows [g*n, (g+1)*n). Exact equality (NaN never ties).
    """
    if group_size < 1 or scores.shape[0] % group_size:
        raise ValueError(f"{scores.shape[0]} scores do not split into groups of {group_size}")
    g = scores.reshape(-1, group_size)
    return (g == g[:, :1]).all(dim=1)


def dynamic_sampling_selection(tied: torch.Tensor, target: int) -> torch.Tensor:
    """Which `target` groups make the batch, (target,) int64 indices into `tied` (G,).

    Groups that did not tie come first, in the order they were sampled; if there are fewer
    than `target` of them (the cap on extra sampling rounds was reached), the batch is
    topped up with tied groups, also in sampling order. Extra untied groups are left out.
    tied: (G,) bool over every group sampled (first round first); G >= target.
    """
    if tied.shape[0] < target:
        raise ValueError(f"{tied.shape[0]} groups cannot fill a batch of {target}")
    order = torch.arange(tied.shape[0], device=tied.device)
    ranked = torch.cat([order[~tied], order[tied]])
    return ranked[:target]
