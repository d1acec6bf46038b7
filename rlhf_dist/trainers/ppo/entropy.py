"""Entropy control in the PPO loop (docs/algorithms.md, "Entropy control"): the tokens
Clip-Cov or KL-Cov act on (ppo.cov_control), chosen once per rollout over all ranks, and
the adaptive entropy coefficient (ppo.entropy_target). The math is algo/entropy.py.

Where this deviates from the paper, and why. Cui et al. (and verl's code) compute each
token's covariance from the CURRENT log-probs with means over the micro-batch at hand,
and draw Clip-Cov's tokens with the global RNG in every micro-batch. Then the chosen
tokens, so the gradient, depend on how a minibatch is cut into micro-batches and ranks,
which no loss here may (docs/architecture.md section 4). So the choice is made once per
rollout, before the update: from the rollout's OLD log-probs and the advantages the
update trains on, with means and the token count over ALL ranks' trained tokens, the
top k (KL-Cov) or the k drawn (Clip-Cov, by numbers hashed from each token's position
in the global rollout) taken over all ranks. With one optimizer step per rollout the
old log-probs ARE the current ones at that step; over several epochs and minibatches the
choice keeps the rollout's view of which tokens would sharpen the policy. Clip-Cov's
candidates are all tokens within the bounds: the authors also leave out those the PPO
clip already cut, which at the rollout's ratio of 1 is none.
"""

from __future__ import annotations

import torch

from rlhf_dist.algo.entropy import (
    EntropyController,
    chosen_tokens,
    covariance_keys,
    position_uniforms,
    selection_count,
    token_covariance,
)
from rlhf_dist.algo.masking import masked_sum
from rlhf_dist.config import PPOConfig
from rlhf_dist.distributed import Runtime
from rlhf_dist.rollout.batch import RolloutBatch
from rlhf_dist.stats import global_moments, global_top_k


def make_entropy_controller(p: PPOConfig) -> EntropyController:
    """ppo.entropy_coef, fixed, or steered towards ppo.entropy_target."""
    return EntropyController(
        p.entropy_coef, p.entropy_target, p.entropy_coef_lr, p.entropy_coef_max
    )


def cov_choice(
    runtime: Runtime,
    batch: RolloutBatch,
    advantages: torch.Tensor,
    p: PPOConfig,
    seed: int,
    it: int,
) -> tuple[torch.Tensor | None, dict]:
    """(the tokens ppo.cov_control acts on, (B, T) bool, or None when it is off; its
    statistics over all ranks). A collective: every rank calls it.

    batch: this rank's rollout as the update sees it (trained response_mask, old
    log-probs); advantages: (B, T), those the update trains on (whitened where the
    estimator whitens); seed, it: the run's seed and the iteration, which key Clip-Cov's
    draw together with each token's global position (rank x B + row, column): the same
    rollout gives the same choice on any number of ranks and micro-batches.
    """
    if p.cov_control == "none":
        return None, {}
    mask, old = batch.response_mask, batch.old_logprobs
    if old is None:  # ppo_update.old_logprobs_from_update keeps them with cov_control on
        raise ValueError("cov_control chooses tokens from the rollout's old log-probs")
    count, lp_mean, _ = global_moments(runtime, old, mask)
    _, adv_mean, _ = global_moments(runtime, advantages, mask)
    cov = token_covariance(old, advantages, mask, lp_mean, adv_mean)
    B, T = mask.shape
    uniforms = None
    if p.cov_control == "clip_cov":
        rows = runtime.rank * B + torch.arange(B, device=mask.device)
        uniforms = position_uniforms(rows, T, seed, it)
    keys = covariance_keys(p.cov_control, cov, mask, uniforms, p.cov_clip_low, p.cov_clip_high)
    k = selection_count(p.cov_ratio, int(count))
    chosen = torch.zeros_like(mask, dtype=torch.bool)
    if k:
        chosen = chosen_tokens(keys, global_top_k(runtime, keys, k)[k - 1])
    sums = [chosen.sum(), torch.isfinite(keys).sum(), masked_sum(cov, mask)]
    total = runtime.all_sum(torch.stack([x.to(torch.float64) for x in sums]))
    n = max(float(count), 1.0)
    stats = {
        "entropy/cov_chosen_frac": float(total[0]) / n,
        "entropy/cov_mean": float(total[2]) / n,
    }
    if p.cov_control == "clip_cov":
        stats["entropy/cov_candidate_frac"] = float(total[1]) / n
    return chosen, stats
