"""Tests for rlhf_dist.algo.rewards.shape_rewards."""

import math

import pytest
import torch

from rlhf_dist.algo.rewards import score_rewards, shape_rewards, token_kl

SEEDS = [0, 1, 2, 3]
KINDS = ["k1", "k2", "k3"]


# ---------------------------------------------------------------------------------------------
# float64 reference: loops over batch and time.
# ---------------------------------------------------------------------------------------------


def ref_shape_rewards(scores, logprobs, ref_logprobs, mask, kl_coef, kind="k1"):
    sc, lp, rf, ms = scores.tolist(), logprobs.tolist(), ref_logprobs.tolist(), mask.tolist()
    n_rows, n_cols = len(lp), len(lp[0])
    rewards = [[0.0] * n_cols for _ in range(n_rows)]
    kl = [[0.0] * n_cols for _ in range(n_rows)]
    for b in range(n_rows):
        last = -1
        for t in range(n_cols):
            if not ms[b][t]:
                continue
            d = lp[b][t] - rf[b][t]
            if kind == "k1":
                k = d
            elif kind == "k2":
                k = 0.5 * d * d
            else:
                k = math.exp(-d) + d - 1.0
            kl[b][t] = k
            rewards[b][t] = -kl_coef * k
            last = t
        if last >= 0:  # rows with an empty mask get no score
            rewards[b][last] += sc[b]
    return (
        torch.tensor(rewards, dtype=torch.float64),
        torch.tensor(kl, dtype=torch.float64),
    )


def _close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual.to(torch.float64), expected, atol=atol, rtol=1e-6)


def _random_inputs(batch, length, seed):
    g = torch.Generator().manual_seed(500 + seed)
    scores = 2.0 * torch.randn(batch, generator=g, dtype=torch.float64)
    lp = -3.0 * torch.rand(batch, length, generator=g, dtype=torch.float64)
    ref = lp + 0.5 * torch.randn(batch, length, generator=g, dtype=torch.float64)
    return scores, lp, ref


# ---------------------------------------------------------------------------------------------
# Hand-computed literal case
# ---------------------------------------------------------------------------------------------


def test_shape_rewards_hand_computed():
    scores = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    lp = torch.tensor(
        [[-1.0, -2.0, -3.0, -4.0], [-1.0, -1.0, -1.0, -1.0], [-0.5, -0.5, -0.5, -0.5]],
        dtype=torch.float64,
    )
    ref = torch.tensor(
        [[-1.5, -2.0, -2.0, 0.0], [0.0, 0.0, 0.0, 0.0], [-1.0, 0.0, -0.5, -1.5]],
        dtype=torch.float64,
    )
    mask = torch.tensor(
        [[True, True, True, False], [False, False, False, False], [True, True, True, True]]
    )
    # k1 = lp - ref, times mask:
    #   row0: [0.5, 0.0, -1.0, (-4 masked) 0]   row1: empty -> 0   row2: [0.5, -0.5, 0.0, 1.0]
    # rewards = -0.1 * kl, plus the score at the last True index:
    #   row0: [-0.05, 0, 0.1 + 1.0, 0] = [-0.05, 0, 1.1, 0]
    #   row1: all 0 (score 2.0 dropped: no response token to put it on)
    #   row2: [-0.05, 0.05, 0, -0.1 + 3.0] = [-0.05, 0.05, 0, 2.9]
    rewards, kl = shape_rewards(scores, lp, ref, mask, 0.1)
    exp_kl = torch.tensor(
        [[0.5, 0.0, -1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.5, -0.5, 0.0, 1.0]], dtype=torch.float64
    )
    exp_rewards = torch.tensor(
        [[-0.05, 0.0, 1.1, 0.0], [0.0, 0.0, 0.0, 0.0], [-0.05, 0.05, 0.0, 2.9]],
        dtype=torch.float64,
    )
    _close(kl, exp_kl, atol=1e-12)
    _close(rewards, exp_rewards, atol=1e-12)
    # kl_kind defaults to "k1"
    rewards_k1, kl_k1 = shape_rewards(scores, lp, ref, mask, 0.1, kl_kind="k1")
    _close(rewards_k1, exp_rewards, atol=1e-12)
    _close(kl_k1, exp_kl, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Reference comparison on ragged masks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", KINDS)
def test_shape_rewards_matches_reference(seed, kind, ragged_mask):
    scores, lp, ref = _random_inputs(6, 10, seed)
    mask = ragged_mask(6, 10, seed)
    rewards, kl = shape_rewards(scores, lp, ref, mask, 0.07, kl_kind=kind)
    assert rewards.shape == (6, 10) and kl.shape == (6, 10)
    exp_rewards, exp_kl = ref_shape_rewards(scores, lp, ref, mask, 0.07, kind)
    _close(kl, exp_kl)
    _close(rewards, exp_rewards)


def test_shape_rewards_float32(ragged_mask):
    scores, lp, ref = _random_inputs(6, 10, 9)
    mask = ragged_mask(6, 10, 9)
    rewards, kl = shape_rewards(scores.float(), lp.float(), ref.float(), mask, 0.05)
    exp_rewards, exp_kl = ref_shape_rewards(scores, lp, ref, mask, 0.05)
    _close(kl, exp_kl, atol=1e-5)
    _close(rewards, exp_rewards, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_score_lands_exactly_at_last_true_index(seed, ragged_mask):
    # With lp == ref the KL is 0 everywhere, so the rewards are exactly the scores at the
    # last response token of each row and 0 elsewhere; empty rows get nothing.
    scores, lp, _ = _random_inputs(6, 10, seed)
    mask = ragged_mask(6, 10, seed)
    rewards, kl = shape_rewards(scores, lp, lp.clone(), mask, 0.3)
    assert torch.all(kl == 0)
    for b in range(6):
        n = int(mask[b].sum())
        for t in range(10):
            want = float(scores[b]) if (n > 0 and t == n - 1) else 0.0
            assert float(rewards[b, t]) == want, (b, t, n)


@pytest.mark.parametrize("kind", KINDS)
def test_kl_and_rewards_are_zero_outside_mask(kind, ragged_mask):
    scores, lp, ref = _random_inputs(6, 10, 4)
    mask = ragged_mask(6, 10, 4)
    rewards, kl = shape_rewards(scores, lp, ref, mask, 0.1, kl_kind=kind)
    assert torch.all(kl[~mask] == 0)
    assert torch.all(rewards[~mask] == 0)


@pytest.mark.parametrize("seed", SEEDS)
def test_padding_columns_change_nothing(seed, ragged_mask, pad_columns):
    scores, lp, ref = _random_inputs(6, 10, seed)
    mask = ragged_mask(6, 10, seed)
    rewards, kl = shape_rewards(scores, lp, ref, mask, 0.1, kl_kind="k3")
    (lp_p, ref_p), mask_p = pad_columns([lp, ref], mask, 3, seed)
    rewards_p, kl_p = shape_rewards(scores, lp_p, ref_p, mask_p, 0.1, kl_kind="k3")
    _close(rewards_p[:, :10], rewards.to(torch.float64), atol=1e-12)
    _close(kl_p[:, :10], kl.to(torch.float64), atol=1e-12)
    assert torch.all(rewards_p[:, 10:] == 0) and torch.all(kl_p[:, 10:] == 0)


def test_inputs_are_not_modified(ragged_mask):
    scores, lp, ref = _random_inputs(6, 10, 5)
    mask = ragged_mask(6, 10, 5)
    originals = [t.clone() for t in (scores, lp, ref, mask)]
    for kind in KINDS:
        shape_rewards(scores, lp, ref, mask, 0.2, kl_kind=kind)
    for now, before in zip((scores, lp, ref, mask), originals, strict=True):
        assert torch.equal(now, before)


def test_score_rewards_hand_computed():
    scores = torch.tensor([2.0, -1.0, 5.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 0, 0]], dtype=torch.bool)
    # row 0: last real token at 1; row 1: at 2 (a gap before it); row 2: nothing
    assert score_rewards(scores, mask).tolist() == [[0, 2, 0], [0, 0, -1], [0, 0, 0]]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_shape_rewards_is_the_score_rewards_minus_the_kl_penalty(seed, kind, ragged_mask):
    g = torch.Generator().manual_seed(seed)
    mask = ragged_mask(6, 10, seed)
    B, T = mask.shape
    lp, ref = -torch.rand(B, T, generator=g), -torch.rand(B, T, generator=g)
    scores = torch.randn(B, generator=g)
    rewards, kl = shape_rewards(scores, lp, ref, mask, 0.3, kind)
    torch.testing.assert_close(kl, token_kl(lp, ref, mask, kind), rtol=0, atol=0)
    expected = score_rewards(scores, mask) - 0.3 * kl
    torch.testing.assert_close(rewards, expected, rtol=1e-6, atol=1e-7)
    assert bool((kl[~mask.bool()] == 0).all())
