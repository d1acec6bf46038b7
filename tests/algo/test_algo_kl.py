"""Tests for rlhf_dist.algo.kl (kl_estimate, FixedKLController, AdaptiveKLController)."""

import math
import random

import pytest
import torch

from rlhf_dist.algo.kl import AdaptiveKLController, FixedKLController, kl_estimate

SEEDS = [0, 1, 2]
KINDS = ["k1", "k2", "k3"]


# ---------------------------------------------------------------------------------------------
# float64 reference: per-element loop with the math module.
# ---------------------------------------------------------------------------------------------


def ref_kl(logprobs, ref_logprobs, kind):
    lp, rf = logprobs.tolist(), ref_logprobs.tolist()
    out = [[0.0] * len(lp[0]) for _ in lp]
    for b in range(len(lp)):
        for t in range(len(lp[0])):
            d = lp[b][t] - rf[b][t]
            if kind == "k1":
                out[b][t] = d
            elif kind == "k2":
                out[b][t] = 0.5 * d * d
            else:  # k3 = exp(ref - lp) - (ref - lp) - 1, with ref - lp = -d
                out[b][t] = math.exp(-d) + d - 1.0
    return torch.tensor(out, dtype=torch.float64)


def ref_adaptive_coefs(init_coef, target, horizon, updates):
    """Expected coef after each (current_kl, n_steps) update (Ziegler et al. 2019)."""
    coef, out = init_coef, []
    for current_kl, n_steps in updates:
        error = min(max(current_kl / target - 1.0, -0.2), 0.2)
        coef = coef * (1.0 + error * n_steps / horizon)
        out.append(coef)
    return out


def _close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual.to(torch.float64), expected, atol=atol, rtol=1e-6)


def _random_logprobs(batch, length, seed, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(batch, length, generator=g, dtype=torch.float64) * 3.0
    ref = lp + spread * torch.randn(batch, length, generator=g, dtype=torch.float64)
    return lp, ref


# ---------------------------------------------------------------------------------------------
# kl_estimate
# ---------------------------------------------------------------------------------------------

# logprobs = [-1.0, -2.0], ref = [-1.5, -1.0]  ->  d = lp - ref = [0.5, -1.0]
_LP = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
_REF = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)


def test_kl_estimate_hand_computed():
    # k1 = d                    = [0.5, -1.0]
    # k2 = 0.5 d^2              = [0.125, 0.5]
    # k3 = exp(-d) - (-d) - 1   : exp(-0.5) + 0.5 - 1 = 0.606531 - 0.5 = 0.106531
    #                             exp(1) - 1 - 1      = 2.718282 - 2   = 0.718282
    _close(kl_estimate(_LP, _REF, "k1"), torch.tensor([[0.5, -1.0]], dtype=torch.float64), 1e-12)
    _close(kl_estimate(_LP, _REF, "k2"), torch.tensor([[0.125, 0.5]], dtype=torch.float64), 1e-12)
    expected_k3 = torch.tensor([[0.10653065971263342, 0.7182818284590451]], dtype=torch.float64)
    _close(kl_estimate(_LP, _REF, "k3"), expected_k3, atol=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", KINDS)
def test_kl_estimate_matches_reference(seed, kind):
    lp, ref = _random_logprobs(4, 7, seed)
    out = kl_estimate(lp, ref, kind)
    assert out.shape == lp.shape
    _close(out, ref_kl(lp, ref, kind))


@pytest.mark.parametrize("kind", KINDS)
def test_kl_estimate_float32(kind):
    lp, ref = _random_logprobs(4, 7, 10)
    _close(kl_estimate(lp.float(), ref.float(), kind), ref_kl(lp, ref, kind), atol=1e-5)


@pytest.mark.parametrize("seed", SEEDS)
def test_k3_and_k2_are_nonnegative(seed):
    # k3 = e^x - x - 1 >= 0 for every real x; check over a wide spread of log-ratios.
    lp, ref = _random_logprobs(8, 16, seed, spread=4.0)
    assert torch.all(kl_estimate(lp, ref, "k3") >= 0)
    assert torch.all(kl_estimate(lp, ref, "k2") >= 0)


def test_all_kinds_are_zero_when_policies_agree():
    lp, _ = _random_logprobs(3, 5, 1)
    for kind in KINDS:
        assert torch.all(kl_estimate(lp, lp.clone(), kind) == 0)


def test_k3_is_half_d_squared_for_small_d():
    # e^x - x - 1 = x^2/2 + x^3/6 + ...; with |d| ~ 1e-3 the relative gap is ~|d|/3 ~ 3e-4.
    # float64 on purpose: in float32, exp(1e-3) - 1e-3 - 1 loses most digits to cancellation.
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(3, 8, generator=g, dtype=torch.float64)
    sign = torch.where(torch.rand(3, 8, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
    d = sign * (0.5e-3 + 1e-3 * torch.rand(3, 8, generator=g, dtype=torch.float64))
    k3 = kl_estimate(lp, lp - d, "k3")
    torch.testing.assert_close(k3.to(torch.float64), 0.5 * d**2, rtol=1e-2, atol=0.0)


def test_k1_and_k3_have_the_same_expectation_under_sampling():
    # Both are unbiased estimators of KL(pi || ref) when tokens are sampled from pi.
    g = torch.Generator().manual_seed(123)
    log_pi = torch.log_softmax(torch.randn(6, generator=g, dtype=torch.float64), dim=0)
    log_ref = torch.log_softmax(torch.randn(6, generator=g, dtype=torch.float64), dim=0)
    exact = float((log_pi.exp() * (log_pi - log_ref)).sum())
    tokens = torch.multinomial(log_pi.exp(), 200_000, replacement=True, generator=g)
    lp, ref = log_pi[tokens].unsqueeze(0), log_ref[tokens].unsqueeze(0)
    k1 = float(kl_estimate(lp, ref, "k1").mean())
    k3 = float(kl_estimate(lp, ref, "k3").mean())
    # Monte-Carlo std error with N = 2e5 is ~1e-3 for these spreads; 0.02 is a loose bound.
    assert k1 == pytest.approx(exact, abs=0.02)
    assert k3 == pytest.approx(exact, abs=0.02)


def test_unknown_kind_is_rejected():
    # Not spelled out in the contract, but silently returning some other estimate for a typo
    # ("k4", "K3") would corrupt training, so any error is acceptable; no error is not.
    with pytest.raises((ValueError, KeyError, NotImplementedError, AssertionError)):
        kl_estimate(_LP, _REF, "k4")


def test_kl_estimate_does_not_modify_inputs():
    lp, ref = _random_logprobs(3, 5, 2)
    lp0, ref0 = lp.clone(), ref.clone()
    for kind in KINDS:
        kl_estimate(lp, ref, kind)
    assert torch.equal(lp, lp0) and torch.equal(ref, ref0)


# ---------------------------------------------------------------------------------------------
# Controllers
# ---------------------------------------------------------------------------------------------


def test_fixed_controller_never_changes():
    ctl = FixedKLController(0.05)
    assert float(ctl.coef) == 0.05
    for current_kl, n_steps in [(0.0, 64), (100.0, 64), (-3.0, 1), (0.05, 1000)]:
        ctl.update(current_kl, n_steps)
        assert float(ctl.coef) == 0.05


def test_adaptive_controller_hand_computed():
    # init 0.2, target 6, horizon 10000
    ctl = AdaptiveKLController(0.2, 6.0, 10000)
    assert float(ctl.coef) == pytest.approx(0.2, rel=1e-12)
    # kl 9: error 9/6 - 1 = 0.5 -> clipped to 0.2; coef = 0.2 * (1 + 0.2*256/10000)
    #       = 0.2 * 1.00512 = 0.201024
    ctl.update(9.0, 256)
    assert float(ctl.coef) == pytest.approx(0.201024, rel=1e-12)
    # kl 3: error 3/6 - 1 = -0.5 -> clipped to -0.2; coef = 0.201024 * (1 - 0.00512)
    #       = 0.201024 * 0.99488 = 0.19999475712
    ctl.update(3.0, 256)
    assert float(ctl.coef) == pytest.approx(0.19999475712, rel=1e-12)
    # kl 6.6: error 6.6/6 - 1 = 0.1 (inside the clip); coef = 0.19999475712 * (1 + 0.1*1000/10000)
    #       = 0.19999475712 * 1.01 = 0.2019947046912
    ctl.update(6.6, 1000)
    assert float(ctl.coef) == pytest.approx(0.2019947046912, rel=1e-12)
    # kl exactly at target: error 0 -> unchanged
    ctl.update(6.0, 5000)
    assert float(ctl.coef) == pytest.approx(0.2019947046912, rel=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
def test_adaptive_controller_follows_formula_over_a_sequence(seed):
    rng = random.Random(seed)
    init, target, horizon = 0.1 + rng.random(), 0.5 + 5 * rng.random(), rng.choice([500, 10000])
    # KLs from far below to far above target, so both clip edges and the linear part occur.
    updates = [(target * rng.uniform(0.0, 2.5), rng.choice([1, 16, 64, 256])) for _ in range(40)]
    expected = ref_adaptive_coefs(init, target, horizon, updates)
    ctl = AdaptiveKLController(init, target, horizon)
    for (current_kl, n_steps), want in zip(updates, expected, strict=True):
        ctl.update(current_kl, n_steps)
        assert float(ctl.coef) == pytest.approx(want, rel=1e-9)
    assert math.isfinite(float(ctl.coef)) and float(ctl.coef) > 0


def test_adaptive_controller_clips_error_at_plus_minus_point_two():
    # A huge KL moves coef exactly as much as kl = 1.2*target; a zero KL as much as 0.8*target.
    a, b = AdaptiveKLController(1.0, 2.0, 100), AdaptiveKLController(1.0, 2.0, 100)
    a.update(1e6, 10)
    b.update(2.4, 10)
    assert float(a.coef) == pytest.approx(float(b.coef), rel=1e-12)
    assert float(a.coef) == pytest.approx(1.02, rel=1e-12)  # 1 * (1 + 0.2*10/100)
    c, d = AdaptiveKLController(1.0, 2.0, 100), AdaptiveKLController(1.0, 2.0, 100)
    c.update(0.0, 10)
    d.update(1.6, 10)
    assert float(c.coef) == pytest.approx(float(d.coef), rel=1e-12)
    assert float(c.coef) == pytest.approx(0.98, rel=1e-12)  # 1 * (1 - 0.2*10/100)


def test_updated_returns_a_new_controller_equal_to_an_in_place_update():
    for make in (lambda: AdaptiveKLController(0.2, 6.0, 100), lambda: FixedKLController(0.2)):
        ctl, moved = make(), make()
        new = ctl.updated(9.0, 32)
        moved.update(9.0, 32)
        assert new is not ctl and ctl.coef == 0.2  # the original is left as it was
        assert new.coef == moved.coef  # bit for bit the in-place step
        assert type(new) is type(ctl)
