"""Tests for rlhf_dist.algo.advantages.gae."""

import pytest
import torch

from rlhf_dist.algo.advantages import gae

SEEDS = [0, 1, 2, 3, 4]
GAMMA_LAM = [(1.0, 0.95), (0.99, 0.95), (0.9, 0.0), (1.0, 1.0), (0.5, 0.7)]


# ---------------------------------------------------------------------------------------------
# float64 reference: a backwards loop per row, written straight from the contract.
# ---------------------------------------------------------------------------------------------


def ref_gae(rewards, values, mask, gamma, lam):
    r, v, m = rewards.tolist(), values.tolist(), mask.tolist()
    n_rows, n_cols = len(r), len(r[0])
    adv = [[0.0] * n_cols for _ in range(n_rows)]
    ret = [[0.0] * n_cols for _ in range(n_rows)]
    for b in range(n_rows):
        next_a = 0.0
        for t in reversed(range(n_cols)):
            # m_{t+1}: beyond the window, and past the last response token, counts as 0,
            # so V_{t+1} and A_{t+1} never bootstrap from padding.
            m_next = 1.0 if (t + 1 < n_cols and m[b][t + 1]) else 0.0
            v_next = v[b][t + 1] if t + 1 < n_cols else 0.0
            delta = r[b][t] + gamma * v_next * m_next - v[b][t]
            a = delta + gamma * lam * m_next * next_a
            if m[b][t]:
                adv[b][t] = a
                ret[b][t] = a + v[b][t]
                next_a = a
            else:
                next_a = 0.0  # never read: m_next is 0 whenever this position is padding
    return torch.tensor(adv, dtype=torch.float64), torch.tensor(ret, dtype=torch.float64)


def _close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual.to(torch.float64), expected, atol=atol, rtol=1e-6)


def _random_inputs(batch, length, seed):
    g = torch.Generator().manual_seed(700 + seed)
    rewards = torch.randn(batch, length, generator=g, dtype=torch.float64)
    values = torch.randn(batch, length, generator=g, dtype=torch.float64)
    return rewards, values


# ---------------------------------------------------------------------------------------------
# Hand-computed literal case
# ---------------------------------------------------------------------------------------------


def test_gae_hand_computed():
    # gamma = 0.5, lam = 0.5 (so gamma*lam = 0.25)
    rewards = torch.tensor(
        [[1.0, 2.0, 100.0], [0.0, 0.0, 1.0], [5.0, 5.0, 5.0]], dtype=torch.float64
    )
    values = torch.tensor([[0.5, 1.0, 50.0], [0.2, 0.4, 0.8], [1.0, 1.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, True, True], [False, False, False]])
    # Row 0, mask [T, T, F] (the 100 / 50 at t=2 are padding and must be ignored):
    #   t=1 (last): delta = 2 + 0 - 1.0 = 1.0            A1 = 1.0
    #   t=0:        delta = 1 + 0.5*1.0 - 0.5 = 1.0      A0 = 1.0 + 0.25*1.0 = 1.25
    #   returns = A + V = [1.75, 2.0, 0]
    # Row 1, mask all True:
    #   t=2: delta = 1 + 0 - 0.8 = 0.2                   A2 = 0.2
    #   t=1: delta = 0 + 0.5*0.8 - 0.4 = 0.0             A1 = 0 + 0.25*0.2 = 0.05
    #   t=0: delta = 0 + 0.5*0.4 - 0.2 = 0.0             A0 = 0 + 0.25*0.05 = 0.0125
    #   returns = [0.2125, 0.45, 1.0]
    # Row 2, empty mask: everything 0.
    adv, ret = gae(rewards, values, mask, 0.5, 0.5)
    exp_adv = torch.tensor(
        [[1.25, 1.0, 0.0], [0.0125, 0.05, 0.2], [0.0, 0.0, 0.0]], dtype=torch.float64
    )
    exp_ret = torch.tensor(
        [[1.75, 2.0, 0.0], [0.2125, 0.45, 1.0], [0.0, 0.0, 0.0]], dtype=torch.float64
    )
    _close(adv, exp_adv, atol=1e-12)
    _close(ret, exp_ret, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Reference comparison on ragged masks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma,lam", GAMMA_LAM)
def test_gae_matches_reference(seed, gamma, lam, ragged_mask):
    rewards, values = _random_inputs(7, 12, seed)
    mask = ragged_mask(7, 12, seed)
    adv, ret = gae(rewards, values, mask, gamma, lam)
    assert adv.shape == (7, 12) and ret.shape == (7, 12)
    exp_adv, exp_ret = ref_gae(rewards, values, mask, gamma, lam)
    _close(adv, exp_adv)
    _close(ret, exp_ret)


def test_gae_float32(ragged_mask):
    rewards, values = _random_inputs(7, 12, 8)
    mask = ragged_mask(7, 12, 8)
    adv, ret = gae(rewards.float(), values.float(), mask, 0.99, 0.95)
    exp_adv, exp_ret = ref_gae(rewards, values, mask, 0.99, 0.95)
    _close(adv, exp_adv, atol=1e-5)
    _close(ret, exp_ret, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_padding_values_never_leak(seed, ragged_mask):
    # Rewrite rewards and values at every padded position with large garbage: advantages
    # and returns must not move anywhere, and padded positions must stay exactly 0.
    rewards, values = _random_inputs(7, 12, seed)
    mask = ragged_mask(7, 12, seed)
    adv, ret = gae(rewards, values, mask, 0.99, 0.95)
    g = torch.Generator().manual_seed(seed)
    junk_r = 50.0 * torch.randn(7, 12, generator=g, dtype=torch.float64)
    junk_v = 50.0 * torch.randn(7, 12, generator=g, dtype=torch.float64)
    adv2, ret2 = gae(
        torch.where(mask, rewards, junk_r), torch.where(mask, values, junk_v), mask, 0.99, 0.95
    )
    torch.testing.assert_close(adv2, adv, atol=1e-12, rtol=0.0)
    torch.testing.assert_close(ret2, ret, atol=1e-12, rtol=0.0)
    for out in (adv, ret, adv2, ret2):
        assert torch.all(out[~mask] == 0)


@pytest.mark.parametrize("seed", SEEDS)
def test_padding_columns_change_nothing(seed, ragged_mask, pad_columns):
    rewards, values = _random_inputs(7, 12, seed)
    mask = ragged_mask(7, 12, seed)
    adv, ret = gae(rewards, values, mask, 1.0, 0.95)
    (rewards_p, values_p), mask_p = pad_columns([rewards, values], mask, 5, seed)
    adv_p, ret_p = gae(rewards_p, values_p, mask_p, 1.0, 0.95)
    torch.testing.assert_close(adv_p[:, :12], adv, atol=1e-12, rtol=0.0)
    torch.testing.assert_close(ret_p[:, :12], ret, atol=1e-12, rtol=0.0)
    assert torch.all(adv_p[:, 12:] == 0) and torch.all(ret_p[:, 12:] == 0)


@pytest.mark.parametrize("seed", SEEDS[:3])
def test_gamma_one_lambda_one_gives_monte_carlo_returns(seed, ragged_mask):
    # With gamma = lam = 1 the value terms telescope: A_t = sum_{k>=t} r_k - V_t over the
    # response, so returns are the plain reward-to-go (independent of V).
    rewards, values = _random_inputs(7, 12, seed)
    mask = ragged_mask(7, 12, seed)
    adv, ret = gae(rewards, values, mask, 1.0, 1.0)
    for b in range(7):
        n = int(mask[b].sum())
        for t in range(n):
            to_go = float(rewards[b, t:n].sum())
            assert float(ret[b, t]) == pytest.approx(to_go, abs=1e-9)
            assert float(adv[b, t]) == pytest.approx(to_go - float(values[b, t]), abs=1e-9)


def test_lambda_zero_gives_one_step_td_errors(ragged_mask):
    # lam = 0: A_t = delta_t = r_t + gamma*V_{t+1} - V_t, and r_T - V_T at the last token.
    rewards, values = _random_inputs(7, 12, 1)
    mask = ragged_mask(7, 12, 1)
    adv, _ = gae(rewards, values, mask, 0.9, 0.0)
    for b in range(7):
        n = int(mask[b].sum())
        for t in range(n):
            v_next = float(values[b, t + 1]) if t + 1 < n else 0.0
            want = float(rewards[b, t]) + 0.9 * v_next - float(values[b, t])
            assert float(adv[b, t]) == pytest.approx(want, abs=1e-12)


def test_inputs_are_not_modified(ragged_mask):
    rewards, values = _random_inputs(7, 12, 2)
    mask = ragged_mask(7, 12, 2)
    originals = [t.clone() for t in (rewards, values, mask)]
    gae(rewards, values, mask, 0.99, 0.95)
    for now, before in zip((rewards, values, mask), originals, strict=True):
        assert torch.equal(now, before)
