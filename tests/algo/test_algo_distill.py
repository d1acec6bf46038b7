"""Tests for rlhf_dist.algo.distill (on-policy distillation's two signals).

The float64 references are plain Python loops over the vocabulary written from the
docstrings (GKD, Agarwal et al. 2024, section 3.1), sharing no code with the module.
"""

import math

import pytest
import torch

from rlhf_dist.algo.distill import distill_advantages, generalized_jsd

SEEDS = [0, 1, 2]
BETAS = [0.0, 0.1, 0.5, 0.9, 1.0]


def _softmax(row: list[float]) -> list[float]:
    top = max(row)
    e = [math.exp(z - top) for z in row]
    return [x / sum(e) for x in e]


def _kl(p: list[float], q: list[float]) -> float:
    return sum(a * math.log(a / b) for a, b in zip(p, q) if a > 0)


def ref_jsd(logits, teacher_logits, beta: float, temperature: float = 1.0) -> torch.Tensor:
    """JSD(beta)(P || Q) row by row; beta 0 / 1 are KL(P||Q) / KL(Q||P)."""
    out = []
    for s_row, t_row in zip(logits.tolist(), teacher_logits.tolist()):
        q = _softmax([z / temperature for z in s_row])
        p = _softmax([z / temperature for z in t_row])
        if beta == 0.0:
            out.append(_kl(p, q))
        elif beta == 1.0:
            out.append(_kl(q, p))
        else:
            m = [beta * a + (1 - beta) * b for a, b in zip(p, q)]
            out.append(beta * _kl(p, m) + (1 - beta) * _kl(q, m))
    return torch.tensor(out, dtype=torch.float64)


def _logits(n: int, v: int, seed: int, spread: float = 2.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (spread * torch.randn(n, v, generator=g, dtype=torch.float64)).to(dtype)


# ------------------------------------------------------------------------- hand-computed


def test_distill_advantages_hand_computed():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.25, -3.0, -9.0]])
    teacher = torch.tensor([[-0.5, -2.5, -0.5], [-2.25, float("nan"), 7.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    # teacher - old on the sampled tokens; padding (a NaN, anything) gives 0
    expected = torch.tensor([[0.5, -0.5, 0.0], [-2.0, 0.0, 0.0]])
    assert torch.equal(distill_advantages(old, teacher, mask), expected)


def test_generalized_jsd_hand_computed():
    # Teacher P = (1/2, 1/2) from logits (0, 0); student Q = (4/5, 1/5) from (ln 4, 0).
    student, teacher = torch.tensor([[math.log(4.0), 0.0]]), torch.tensor([[0.0, 0.0]])
    forward = 0.5 * math.log(0.5 / 0.8) + 0.5 * math.log(0.5 / 0.2)  # KL(P || Q)
    reverse = 0.8 * math.log(0.8 / 0.5) + 0.2 * math.log(0.2 / 0.5)  # KL(Q || P)
    # beta 1/2: M = (0.65, 0.35)
    kl_pm = 0.5 * math.log(0.5 / 0.65) + 0.5 * math.log(0.5 / 0.35)
    kl_qm = 0.8 * math.log(0.8 / 0.65) + 0.2 * math.log(0.2 / 0.35)
    half = 0.5 * kl_pm + 0.5 * kl_qm
    assert forward == pytest.approx(0.2231436, abs=1e-6)
    assert reverse == pytest.approx(0.1927448, abs=1e-6)
    assert half == pytest.approx(0.0506717, abs=1e-6)
    for beta, want in ((0.0, forward), (1.0, reverse), (0.5, half)):
        got = generalized_jsd(student, teacher, beta)
        assert got.shape == (1,) and float(got[0]) == pytest.approx(want, abs=1e-6), beta
    # temperature 2 halves the logits: Q = (2/3, 1/3) against the uniform P
    tempered = 2 / 3 * math.log(4 / 3) + 1 / 3 * math.log(2 / 3)
    got = generalized_jsd(student, teacher, 1.0, temperature=2.0)
    assert float(got[0]) == pytest.approx(tempered, abs=1e-6)


# ------------------------------------------------------------------------------ properties


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("seed", SEEDS)
def test_generalized_jsd_matches_the_float64_loop(beta, seed):
    s, t = _logits(5, 11, seed), _logits(5, 11, seed + 100)
    torch.testing.assert_close(generalized_jsd(s, t, beta), ref_jsd(s, t, beta), atol=1e-10, rtol=0)
    s32, t32 = s.float(), t.float()
    got = generalized_jsd(s32, t32, beta, temperature=0.7)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref_jsd(s32, t32, beta, 0.7), atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("seed", SEEDS)
def test_generalized_jsd_end_points_are_the_limits_of_the_scaled_divergence(seed):
    s, t = _logits(4, 9, seed), _logits(4, 9, seed + 7)
    forward, reverse = generalized_jsd(s, t, 0.0), generalized_jsd(s, t, 1.0)
    eps = 1e-5
    # JSD(beta) / beta -> KL(P || Q) as beta -> 0; JSD(beta) / (1 - beta) -> KL(Q || P)
    torch.testing.assert_close(generalized_jsd(s, t, eps) / eps, forward, rtol=1e-3, atol=1e-6)
    near_one = generalized_jsd(s, t, 1 - eps) / eps
    torch.testing.assert_close(near_one, reverse, rtol=1e-3, atol=1e-6)
    # and JSD(beta) itself vanishes at both ends
    assert float(generalized_jsd(s, t, eps).max()) < 1e-3 * float(forward.max())


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("seed", SEEDS)
def test_generalized_jsd_is_nonnegative_zero_on_equal_and_swaps_with_one_minus_beta(beta, seed):
    s, t = _logits(6, 13, seed), _logits(6, 13, seed + 3)
    d = generalized_jsd(s, t, beta)
    assert d.shape == (6,) and bool((d > 0).all())
    # the same distribution (logits shifted by a constant) has no divergence
    same = generalized_jsd(s, s + 5.0, beta)
    torch.testing.assert_close(same, torch.zeros(6, dtype=torch.float64), atol=1e-12, rtol=0)
    # JSD(beta)(P || Q) = JSD(1 - beta)(Q || P): the roles of teacher and student swap
    torch.testing.assert_close(generalized_jsd(t, s, 1.0 - beta), d, atol=1e-12, rtol=0)


@pytest.mark.parametrize("seed", SEEDS)
def test_generalized_jsd_temperature_scales_both_logits(seed):
    s, t = _logits(3, 7, seed), _logits(3, 7, seed + 1)
    got = generalized_jsd(s, t, 0.3, temperature=0.7)
    torch.testing.assert_close(got, generalized_jsd(s / 0.7, t / 0.7, 0.3), atol=1e-12, rtol=0)


@pytest.mark.parametrize("seed", SEEDS)
def test_sampled_advantage_is_the_reverse_kl_in_expectation_value_and_gradient(seed):
    """The two signals agree: over the student's own sampling distribution q, the mean of
    distill_advantages (log p - log q of the sampled token) is -KL(q || p) = -GJSD(1), and
    the expected policy gradient E_q[A(y) grad log q(y)] is -grad KL(q || p) (score-function
    identity): the sampled-token signal descends the full reverse KL in expectation."""
    V = 9
    z = _logits(1, V, seed).requires_grad_(True)
    t = _logits(1, V, seed + 11)
    logq, logp = torch.log_softmax(z, -1), torch.log_softmax(t, -1)
    every_token = torch.ones(V, V, dtype=torch.bool)
    # row y: the student "sampled" token y; columns broadcast log-probs of each y
    adv = distill_advantages(logq.detach().T.expand(V, V), logp.T.expand(V, V), every_token)[:, 0]
    q = logq.detach().exp()[0]
    reverse = generalized_jsd(z, t, 1.0)
    assert float((q * adv).sum()) == pytest.approx(-float(reverse.detach()[0]), abs=1e-12)
    (grad_kl,) = torch.autograd.grad(reverse.sum(), z)
    (grad_pg,) = torch.autograd.grad((q * adv.detach() * logq[0]).sum(), z)
    torch.testing.assert_close(grad_pg, -grad_kl, atol=1e-12, rtol=0)


def test_gradients_reach_only_what_requires_them_and_inputs_are_untouched():
    s = _logits(3, 5, 0).requires_grad_(True)
    t = _logits(3, 5, 1)
    before = (s.detach().clone(), t.clone())
    generalized_jsd(s, t, 0.5).sum().backward()
    assert s.grad is not None and bool(s.grad.abs().sum() > 0) and t.grad is None
    assert torch.equal(s.detach(), before[0]) and torch.equal(t, before[1])
    old, teacher = torch.randn(2, 4), torch.randn(2, 4)
    mask = torch.tensor([[True, True, False, False], [True, False, False, False]])
    copies = (old.clone(), teacher.clone(), mask.clone())
    distill_advantages(old, teacher, mask)
    assert all(torch.equal(a, b) for a, b in zip((old, teacher, mask), copies))


@pytest.mark.parametrize("beta", [-0.1, 1.5, float("nan")])
def test_beta_outside_zero_one_is_an_error(beta):
    with pytest.raises(ValueError, match="beta"):
        generalized_jsd(torch.zeros(1, 2), torch.zeros(1, 2), beta)
