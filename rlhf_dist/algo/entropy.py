"""Entropy control: the covariance-based token choices of Clip-Cov and KL-Cov (Cui et al.
2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models")
and an entropy-bonus coefficient steered towards a target entropy (SAC's temperature,
Haarnoja et al. 2018, "Soft Actor-Critic Algorithms and Applications", section 5).

Cui et al. show that under policy gradient the entropy of a softmax policy falls by about
the covariance, over the sampled tokens, of log pi(y_t) and the advantage A_t: a likely
token with a high advantage sharpens the policy. Clip-Cov stops the gradient of a few
randomly chosen tokens whose centred product (log pi - mean)(A - mean) lies within
bounds; KL-Cov adds a penalty |log pi - log pi_old| to the tokens with the largest one.

The trainer computes the choice ONCE per rollout, from the rollout's old log-probs and
the advantages the update trains on, with means over ALL ranks' trained tokens and a
count over all of them (trainers/ppo/entropy.py). Here are the pieces that involve no
collective; each is elementwise given those global numbers, so a micro-batch's loss
depends only on its own rows and the split-invariance rule (docs/algorithms.md) holds.
Shapes: B rows, T response tokens.
"""

from __future__ import annotations

import math

import torch

_MASK32 = 0xFFFFFFFF


def token_covariance(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    logprob_mean: float | torch.Tensor,
    advantage_mean: float | torch.Tensor,
) -> torch.Tensor:
    """Each token's centred product (log pi(y_t) - mean)(A_t - mean), Cui et al.'s Cov(y_t)
    whose mean over the batch is the covariance that drives entropy down; (B, T) float64,
    0 outside the mask.

    logprobs, advantages: (B, T); response_mask: (B, T) bool; the means: over the whole
    batch's masked tokens (over all ranks: `stats.global_moments`), 0-dim or numbers.
    float64 so that the ranking of nearly equal products does not depend on fp32 rounding.
    """
    lp = logprobs.detach().to(torch.float64) - torch.as_tensor(logprob_mean, dtype=torch.float64)
    adv = advantages.detach().to(torch.float64) - torch.as_tensor(
        advantage_mean, dtype=torch.float64
    )
    return torch.where(response_mask.bool(), lp * adv, torch.zeros_like(lp))


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply rounds) of int64 x in [0, 2^32), any
    shape, elementwise (same shape). The
    multipliers are odd and below 2^31, so every product stays below 2^63: exact int64
    arithmetic, the same bits on every device."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x446CA68B) & _MASK32
    return x ^ (x >> 16)


def position_uniforms(rows: torch.Tensor, width: int, seed: int, step: int) -> torch.Tensor:
    """Uniform numbers in [0, 1), one per token, (B, width) float64: a hash of (seed, step,
    row, column) with 53 random bits, so a token's number depends on its position in the
    GLOBAL rollout only, never on the batch, micro-batch or rank that holds it.

    rows: (B,) int64 global row indices (>= 0); width: T; seed, step: ints (the run's seed
    and the iteration). Counter-based like Philox: no generator state to carry or restore.
    """
    if rows.dim() != 1 or width < 0:
        raise ValueError(f"rows must be (B,) and width >= 0, got {tuple(rows.shape)}, {width}")
    key = _mix32(torch.tensor(seed & _MASK32, dtype=torch.int64, device=rows.device))
    key = _mix32(key ^ (step & _MASK32))
    h = _mix32(key ^ (rows.to(torch.int64) & _MASK32))[:, None]
    cols = torch.arange(width, dtype=torch.int64, device=rows.device)[None, :]
    high = _mix32(h ^ cols)  # 32 bits
    low = _mix32(high ^ 0x5BD1E995) >> 11  # 21 more bits
    return (high * 2**21 + low).to(torch.float64) / 2.0**53


def covariance_keys(
    method: str,
    covariance: torch.Tensor,
    response_mask: torch.Tensor,
    uniforms: torch.Tensor | None = None,
    low: float = 1.0,
    high: float = 5.0,
) -> torch.Tensor:
    """Ranking keys of the tokens a method may choose, (B, T) float64; the trainer takes
    the k = `selection_count` LARGEST keys over all ranks; -inf marks a token never chosen.

    clip_cov: the candidates are the tokens with low < Cov < high (Cui et al.'s
    omega_low, omega_high), ranked by `uniforms` (B, T) in [0, 1): the k largest of
    independent uniforms are k candidates drawn uniformly without replacement.
    kl_cov: every masked token, ranked by its covariance (the top-k of Cui et al.).
    covariance: `token_covariance`, (B, T); response_mask: (B, T) bool.
    """
    mask = response_mask.bool()
    never = torch.full_like(covariance, -math.inf, dtype=torch.float64)
    if method == "kl_cov":
        return torch.where(mask, covariance.to(torch.float64), never)
    if method == "clip_cov":
        if uniforms is None:
            raise ValueError("clip_cov draws among its candidates: uniforms are required")
        candidate = mask & (covariance > low) & (covariance < high)
        return torch.where(candidate, uniforms.to(torch.float64), never)
    raise ValueError(f"covariance method must be clip_cov or kl_cov, got {method!r}")


def selection_count(ratio: float, n_tokens: int) -> int:
    """How many tokens a method chooses among `n_tokens` trained tokens (over all ranks):
    floor(ratio x n_tokens), at least one when there is any token (as the authors' code,
    verl's clip_cov / kl_cov, so a small batch still gets its choice); 0 without tokens."""
    if not 0 < ratio <= 1:
        raise ValueError(f"selection ratio must be in (0, 1], got {ratio}")
    return max(1, math.floor(ratio * n_tokens)) if n_tokens > 0 else 0


def chosen_tokens(keys: torch.Tensor, threshold: float | torch.Tensor) -> torch.Tensor:
    """The tokens whose key is finite and >= `threshold` (the k-th largest key over all
    ranks; -inf when fewer than k tokens may be chosen: then all of them), (B, T) bool.
    keys: (B, T) from `covariance_keys`."""
    return torch.isfinite(keys) & (keys >= torch.as_tensor(threshold, dtype=keys.dtype))


def clip_cov_loss(per_token_loss: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Clip-Cov: the policy loss with no gradient through the chosen tokens, (B, T); its
    value is unchanged (the authors' code zeroes it; only the gradient matters, and the
    logged policy/loss stays comparable with a run without Clip-Cov).
    per_token_loss: (B, T); chosen: (B, T) bool."""
    return torch.where(chosen, per_token_loss.detach(), per_token_loss)


def kl_cov_penalty(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, chosen: torch.Tensor, coef: float
) -> torch.Tensor:
    """KL-Cov's penalty coef x |log pi - log pi_old| on the chosen tokens, 0 elsewhere,
    (B, T), to ADD to the per-token loss (the authors' code penalises the absolute
    log-ratio, a first-order KL(pi_old || pi) that holds a chosen token near its old
    probability in either direction). logprobs: (B, T) with gradient; old_logprobs:
    (B, T); chosen: (B, T) bool."""
    penalty = coef * (logprobs - old_logprobs.detach()).abs()
    return torch.where(chosen, penalty, torch.zeros_like(penalty))


class EntropyController:
    """The coefficient of the entropy bonus: fixed (target None), or steered towards
    `target` nats per token like SAC's temperature (Haarnoja et al. 2018, section 5, the
    objective J(alpha) = E[-alpha log pi - alpha H_target], one gradient step per update):

        coef <- clip(coef + lr x (target - entropy), 0, max_coef)

    It rises while the measured entropy is below the target and falls back (to 0 at
    least) once it is above: an integral controller, so a constant gap keeps moving it.
    `entropy`: the mean per-token entropy over all ranks' tokens (the trainer's
    objective/entropy). Linear rather than in log space so it can start at and return to 0.
    """

    def __init__(
        self, coef: float, target: float | None = None, lr: float = 0.0, max_coef: float = 1.0
    ):
        if target is not None and (target <= 0 or lr <= 0 or not 0 <= coef <= max_coef):
            raise ValueError(
                "EntropyController needs target > 0, lr > 0 and 0 <= coef <= max_coef, got "
                f"target={target}, lr={lr}, coef={coef}, max_coef={max_coef}"
            )
        self.coef = float(coef)
        self.target = None if target is None else float(target)
        self.lr = float(lr)
        self.max_coef = float(max_coef)

    def update(self, entropy: float) -> None:
        """One step from the entropy measured this iteration; fixed: nothing to adapt.
        A non-finite measurement leaves the coefficient as it was."""
        if self.target is None or not math.isfinite(entropy):
            return
        step = self.lr * (self.target - float(entropy))
        self.coef = min(max(self.coef + step, 0.0), self.max_coef)

    def state_dict(self) -> dict:
        return {"coef": self.coef}

    def load_state_dict(self, state: dict) -> None:
        self.coef = float(state["coef"])
