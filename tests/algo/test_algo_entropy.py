"""Tests for rlhf_dist.algo.entropy: the token covariance, the position hash, Clip-Cov's and
KL-Cov's keys, choices and terms, and the adaptive entropy coefficient. A hand case and a
property for each."""

import math
import random

import pytest
import torch

from rlhf_dist.algo.entropy import (
    EntropyController,
    chosen_tokens,
    clip_cov_loss,
    covariance_keys,
    kl_cov_penalty,
    position_uniforms,
    selection_count,
    token_covariance,
)

SEEDS = [0, 1, 2]


def _batch(seed, ragged_mask, B=6, T=9):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    return lp, adv, ragged_mask(B, T, seed)


# ------------------------------------------------------------------------ token_covariance


def test_token_covariance_by_hand():
    # log pi = [[-1, -3], [-2, pad]], A = [[2, 0], [1, pad]]: masked means -2 and 1.
    lp = torch.tensor([[-1.0, -3.0], [-2.0, 9.0]])
    adv = torch.tensor([[2.0, 0.0], [1.0, 7.0]])
    mask = torch.tensor([[True, True], [True, False]])
    cov = token_covariance(lp, adv, mask, -2.0, 1.0)
    # (1)(1) = 1, (-1)(-1) = 1, (0)(0) = 0, padding 0
    assert cov.dtype == torch.float64
    assert cov.tolist() == [[1.0, 1.0], [0.0, 0.0]]


@pytest.mark.parametrize("seed", SEEDS)
def test_token_covariance_mean_is_the_covariance_and_rows_are_independent(seed, ragged_mask):
    lp, adv, mask = _batch(seed, ragged_mask)
    n = mask.sum()
    lp_mean, adv_mean = lp[mask].mean(), adv[mask].mean()
    cov = token_covariance(lp, adv, mask, lp_mean, adv_mean)
    # The mean over the masked tokens is the population covariance of (log pi, A).
    expected = ((lp[mask] - lp_mean) * (adv[mask] - adv_mean)).sum() / n
    assert float(cov.sum() / n) == pytest.approx(float(expected), rel=1e-12)
    # Each token's value reads that token and the two (global) means only: any subset of
    # rows gives the same values, so a micro-batch or rank computes its part alone.
    rows = [0, 3, 4]
    part = token_covariance(lp[rows], adv[rows], mask[rows], lp_mean, adv_mean)
    assert torch.equal(part, cov[rows])
    assert (cov[~mask] == 0).all()


# ----------------------------------------------------------------------- position_uniforms


def test_position_uniforms_by_hand():
    u = position_uniforms(torch.tensor([0, 7]), 3, seed=0, step=1)
    assert u.shape == (2, 3) and u.dtype == torch.float64
    assert ((u >= 0) & (u < 1)).all()
    # 53 random bits: every value is a multiple of 2^-53, and the six differ.
    assert torch.equal(u * 2.0**53, (u * 2.0**53).round())
    assert len(set(u.flatten().tolist())) == 6
    # Another seed or step gives other numbers at the same positions.
    assert not torch.equal(u, position_uniforms(torch.tensor([0, 7]), 3, seed=1, step=1))
    assert not torch.equal(u, position_uniforms(torch.tensor([0, 7]), 3, seed=0, step=2))
    with pytest.raises(ValueError):
        position_uniforms(torch.zeros(2, 2, dtype=torch.long), 3, 0, 0)


@pytest.mark.parametrize("seed", SEEDS)
def test_position_uniforms_depend_on_the_position_only_and_look_uniform(seed):
    full = position_uniforms(torch.arange(256), 128, seed, step=5)
    # A token's number does not depend on the rows beside it nor on the batch's width.
    rows = torch.tensor([200, 3, 77])
    assert torch.equal(position_uniforms(rows, 50, seed, 5), full[rows, :50])
    # 32768 numbers: mean 1/2 and variance 1/12 within a few standard errors, every
    # tenth of [0, 1) holds ~10% of them (a binomial's sd is 0.17%).
    x = full.flatten()
    assert abs(float(x.mean()) - 0.5) < 4 * math.sqrt(1 / 12 / x.numel())
    assert abs(float(x.var()) - 1 / 12) < 0.003
    counts = torch.histc(x.float(), bins=10, min=0.0, max=1.0) / x.numel()
    assert (counts - 0.1).abs().max() < 0.01, counts
    # Neighbouring columns are not correlated.
    a, b = full[:, :-1].flatten(), full[:, 1:].flatten()
    assert abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < 0.03


# ------------------------------------------------------------------- keys and the choice


def test_covariance_keys_and_choice_by_hand():
    cov = torch.tensor([[0.5, 2.0, 6.0], [3.0, 1.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    u = torch.tensor([[0.9, 0.2, 0.8], [0.7, 0.1, 0.3]], dtype=torch.float64)
    inf = math.inf
    # Clip-Cov: candidates strictly inside (1, 5): 2.0 and 3.0, ranked by their numbers.
    clip = covariance_keys("clip_cov", cov, mask, u, 1.0, 5.0)
    assert clip.tolist() == [[-inf, 0.2, -inf], [0.7, -inf, -inf]]
    # KL-Cov: every masked token, ranked by its covariance; padding never.
    kl = covariance_keys("kl_cov", cov, mask)
    assert kl.tolist() == [[0.5, 2.0, 6.0], [3.0, 1.0, -inf]]
    # The 2 largest KL-Cov keys are 6 and 3: the threshold is the 2nd, 3.0.
    assert chosen_tokens(kl, 3.0).tolist() == [[False, False, True], [True, False, False]]
    # k above the number of candidates: the threshold is -inf, every candidate is chosen.
    assert chosen_tokens(clip, -inf).tolist() == [[False, True, False], [True, False, False]]
    with pytest.raises(ValueError):
        covariance_keys("clip_cov", cov, mask)  # no uniforms
    with pytest.raises(ValueError):
        covariance_keys("top", cov, mask)


def test_selection_count_by_hand():
    assert selection_count(2e-4, 100_000) == 20
    assert selection_count(2e-4, 1000) == 1  # at least one token
    assert selection_count(0.5, 7) == 3
    assert selection_count(0.1, 0) == 0
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError):
            selection_count(bad, 10)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("method", ["clip_cov", "kl_cov"])
def test_the_k_largest_keys_choose_k_tokens_whatever_the_row_order(seed, method, ragged_mask):
    lp, adv, mask = _batch(seed, ragged_mask, B=8, T=9)
    cov = token_covariance(lp, adv, mask, lp[mask].mean(), adv[mask].mean())
    u = position_uniforms(torch.arange(8), 9, seed, 0)
    keys = covariance_keys(method, cov, mask, u, -0.5, 0.5)
    finite = keys[torch.isfinite(keys)]
    k = min(selection_count(0.2, int(mask.sum())), finite.numel())
    threshold = finite.topk(k).values[-1]
    chosen = chosen_tokens(keys, threshold)
    assert int(chosen.sum()) == k and not (chosen & ~mask).any()
    if method == "kl_cov":  # the chosen are the k largest covariances
        assert cov[chosen].min() >= cov[mask & ~chosen].max()
    else:  # the chosen are candidates, inside the bounds
        assert ((cov[chosen] > -0.5) & (cov[chosen] < 0.5)).all()
    # Shuffling the rows (with their global positions) shuffles the choice alike.
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(seed))
    keys_p = covariance_keys(method, cov[perm], mask[perm], u[perm], -0.5, 0.5)
    assert torch.equal(chosen_tokens(keys_p, threshold), chosen[perm])


# ------------------------------------------------------------------------- the two terms


def test_clip_cov_loss_keeps_the_value_and_stops_the_chosen_gradients():
    lp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    adv = torch.tensor([[1.0, -2.0, 3.0]])
    chosen = torch.tensor([[False, True, False]])
    loss = clip_cov_loss(-adv * lp, chosen)
    assert loss.tolist() == [[1.0, -4.0, 1.5]]  # values as before
    loss.sum().backward()
    assert lp.grad.tolist() == [[-1.0, 0.0, -3.0]]  # d(-A lp)/d lp = -A, 0 where chosen


@pytest.mark.parametrize("seed", SEEDS)
def test_clip_cov_loss_gradient_is_the_unchosen_tokens_only(seed):
    g = torch.Generator().manual_seed(seed)
    lp = torch.randn(4, 6, generator=g, requires_grad=True)
    adv = torch.randn(4, 6, generator=g)
    chosen = torch.rand(4, 6, generator=g) < 0.3
    clip_cov_loss(-adv * lp.exp(), chosen).sum().backward()
    expected = torch.where(chosen, 0.0, -adv * lp.detach().exp())
    torch.testing.assert_close(lp.grad, expected)


def test_kl_cov_penalty_by_hand():
    lp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old = torch.tensor([[-1.5, -1.0, -0.5]])
    chosen = torch.tensor([[True, True, False]])
    penalty = kl_cov_penalty(lp, old, chosen, coef=2.0)
    assert penalty.tolist() == [[1.0, 2.0, 0.0]]  # 2 x |0.5|, 2 x |-1|, not chosen
    penalty.sum().backward()
    assert lp.grad.tolist() == [[2.0, -2.0, 0.0]]  # coef x sign(log ratio)


@pytest.mark.parametrize("seed", SEEDS)
def test_kl_cov_penalty_is_nonnegative_zero_at_ratio_one_and_row_local(seed):
    g = torch.Generator().manual_seed(seed)
    lp, old = -torch.rand(5, 7, generator=g) * 3, -torch.rand(5, 7, generator=g) * 3
    chosen = torch.rand(5, 7, generator=g) < 0.4
    p = kl_cov_penalty(lp, old, chosen, 0.7)
    assert (p >= 0).all() and (p[~chosen] == 0).all()
    # At the rollout's own log-probs (one optimizer step per rollout) it is 0, gradient too.
    at_old = old.clone().requires_grad_(True)
    kl_cov_penalty(at_old, old, chosen, 0.7).sum().backward()
    assert (at_old.grad == 0).all()
    assert torch.equal(kl_cov_penalty(lp[2:4], old[2:4], chosen[2:4], 0.7), p[2:4])


# ---------------------------------------------------------------------- EntropyController


def test_entropy_controller_by_hand():
    c = EntropyController(0.0, target=2.0, lr=0.1, max_coef=0.25)
    c.update(1.0)  # below the target by 1 nat: + 0.1
    assert c.coef == pytest.approx(0.1)
    c.update(0.5)  # + 0.15, capped at 0.25
    assert c.coef == pytest.approx(0.25)
    c.update(4.0)  # above by 2: - 0.2
    assert c.coef == pytest.approx(0.05)
    c.update(3.0)  # - 0.1, floored at 0
    assert c.coef == 0.0
    c.update(float("nan"))  # a non-finite measurement changes nothing
    assert c.coef == 0.0
    fixed = EntropyController(0.01)
    fixed.update(0.0)
    assert fixed.coef == 0.01
    restored = EntropyController(0.0, 2.0, 0.1, 1.0)
    restored.load_state_dict(c.state_dict() | {"coef": 0.3})
    assert restored.coef == 0.3
    for bad in ({"target": 0.0}, {"lr": 0.0}, {"coef": 2.0}):
        with pytest.raises(ValueError):
            EntropyController(**({"coef": 0.0, "target": 1.0, "lr": 0.1} | bad))


@pytest.mark.parametrize("seed", SEEDS)
def test_entropy_controller_stays_in_bounds_and_moves_towards_the_target(seed):
    rng = random.Random(seed)
    c = EntropyController(0.05, target=1.5, lr=rng.uniform(0.01, 0.5), max_coef=0.2)
    for _ in range(200):
        before, entropy = c.coef, rng.uniform(0.0, 3.0)
        c.update(entropy)
        assert 0.0 <= c.coef <= 0.2
        # Below the target the bonus never shrinks, above it never grows.
        assert (c.coef >= before) if entropy < 1.5 else (c.coef <= before)
        # Unclipped, the step is exactly lr x (target - entropy).
        if 0.0 < c.coef < 0.2:
            assert c.coef - before == pytest.approx(c.lr * (1.5 - entropy), abs=1e-12)
