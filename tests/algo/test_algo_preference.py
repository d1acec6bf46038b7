"""Tests for rlhf_dist.algo.preference (sequence_logprobs, DPO / cDPO / IPO, KTO, SimPO, ORPO)."""

import math

import pytest
import torch

from rlhf_dist.algo.preference import (
    best_worst_pairs,
    dpo_loss,
    dpo_terms,
    kto_loss,
    kto_reference_point,
    kto_terms,
    log_odds,
    orpo_loss,
    orpo_terms,
    sequence_logprobs,
    simpo_loss,
    simpo_terms,
)

SEEDS = [0, 1, 2]


# ---------------------------------------------------------------------------------------------
# float64 references: plain Python loops over tokens and pairs, sharing no code with the module.
# ---------------------------------------------------------------------------------------------


def ref_sequence_logprobs(logprobs, mask):
    lp, m = logprobs.tolist(), mask.tolist()
    return [sum(lp[b][t] for t in range(len(lp[b])) if m[b][t]) for b in range(len(lp))]


def _log_sigmoid(z):
    # log(1 / (1 + e^-z)), written both ways so neither overflows.
    return -math.log1p(math.exp(-z)) if z >= 0 else z - math.log1p(math.exp(z))


def ref_dpo(pc, pr, rc, rr, beta, loss_type, eps):
    """Mean loss, mean chosen/rejected rewards, mean margin, accuracy."""
    n = len(pc)
    loss = chosen = rejected = correct = 0.0
    for i in range(n):
        cr, rj = pc[i] - rc[i], pr[i] - rr[i]
        h = cr - rj
        if loss_type == "sigmoid":
            loss += -(1 - eps) * _log_sigmoid(beta * h) - eps * _log_sigmoid(-beta * h)
        else:
            loss += (h - 1 / (2 * beta)) ** 2
        chosen += beta * cr
        rejected += beta * rj
        correct += 1 if beta * cr > beta * rj else 0
    return loss / n, chosen / n, rejected / n, (chosen - rejected) / n, correct / n


def ref_kto(lp, ref, desirable, kl_lp, kl_ref, beta, wd, wu):
    z0 = max(0.0, sum(a - b for a, b in zip(kl_lp, kl_ref)) / len(kl_lp))
    loss = 0.0
    for i in range(len(lp)):
        r = lp[i] - ref[i]
        if desirable[i]:
            loss += wd - wd / (1 + math.exp(-beta * (r - z0)))
        else:
            loss += wu - wu / (1 + math.exp(-beta * (z0 - r)))
    return loss / len(lp), z0


def _seq_inputs(seed, n=6, scale=8.0):
    g = torch.Generator().manual_seed(seed)
    return [-scale * torch.rand(n, generator=g, dtype=torch.float64) - 1.0 for _ in range(4)]


# ---------------------------------------------------------------------------------------------
# sequence_logprobs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_sequence_logprobs_matches_loop_and_ignores_padding(seed, ragged_mask, pad_columns):
    mask = ragged_mask(6, 9, seed)
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(6, 9, generator=g, dtype=torch.float64) * 5
    got = sequence_logprobs(lp, mask)
    assert got.shape == (6,)
    assert torch.allclose(got, torch.tensor(ref_sequence_logprobs(lp, mask), dtype=torch.float64))
    # Garbage (even NaN) in padded columns changes nothing.
    (lp_pad,), mask_pad = pad_columns([lp], mask, 3, seed)
    lp_pad[:, -1] = float("nan")
    assert torch.equal(sequence_logprobs(lp_pad, mask_pad), got)
    assert got[mask.sum(1) == 0].eq(0).all(), "an empty response has log-prob 0"


# ---------------------------------------------------------------------------------------------
# DPO
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    "loss_type,eps,beta", [("sigmoid", 0.0, 0.1), ("sigmoid", 0.2, 0.5), ("ipo", 0.0, 0.3)]
)
def test_dpo_matches_float64_reference(seed, loss_type, eps, beta):
    pc, pr, rc, rr = _seq_inputs(seed)
    loss, stats = dpo_loss(pc, pr, rc, rr, beta, loss_type, eps)
    want = ref_dpo(pc.tolist(), pr.tolist(), rc.tolist(), rr.tolist(), beta, loss_type, eps)
    got = [
        loss,
        stats["chosen_rewards"],
        stats["rejected_rewards"],
        stats["margins"],
        stats["accuracy"],
    ]
    for g, w in zip(got, want):
        assert g.dim() == 0
        assert abs(float(g) - w) < 1e-9, (float(g), w)
    terms = dpo_terms(pc, pr, rc, rr, beta, loss_type, eps)
    assert terms["loss"].shape == (6,)
    assert torch.allclose(terms["loss"].mean(), loss)


def test_dpo_from_token_logprobs_on_ragged_masks(ragged_mask):
    """The chain a trainer runs: token log-probs -> masked sums -> DPO, against one loop."""
    g = torch.Generator().manual_seed(5)
    tokens = [-3 * torch.rand(5, 7, generator=g, dtype=torch.float64) for _ in range(4)]
    masks = [ragged_mask(5, 7, s) for s in range(2)]
    sums = [sequence_logprobs(t, masks[i % 2]) for i, t in enumerate(tokens)]
    loss, _ = dpo_loss(*sums, beta=0.2)
    ref = [ref_sequence_logprobs(t, masks[i % 2]) for i, t in enumerate(tokens)]
    assert abs(float(loss) - ref_dpo(*ref, 0.2, "sigmoid", 0.0)[0]) < 1e-9


def test_dpo_at_the_reference_is_log2_and_its_gradient_favours_chosen():
    pc = torch.tensor([-5.0, -9.0, -2.0], dtype=torch.float64, requires_grad=True)
    pr = torch.tensor([-4.0, -3.0, -8.0], dtype=torch.float64, requires_grad=True)
    loss, stats = dpo_loss(pc, pr, pc.detach(), pr.detach(), beta=0.1)
    assert abs(float(loss.detach()) - math.log(2)) < 1e-12
    assert float(stats["accuracy"]) == 0.0, "ties count as wrong"
    loss.backward()
    # d loss / d log pi(chosen) = -beta * sigmoid(0) / B: raising the chosen lowers the loss,
    # raising the rejected raises it, equally.
    assert torch.allclose(pc.grad, torch.full((3,), -0.1 * 0.5 / 3, dtype=torch.float64))
    assert torch.allclose(pr.grad, -pc.grad)
    assert pc.grad.ne(0).all()


def test_label_smoothing_is_the_loss_of_the_flipped_label_mixed_in():
    pc, pr, rc, rr = _seq_inputs(7)
    eps = 0.3
    plain = dpo_terms(pc, pr, rc, rr, 0.5)["loss"]
    flipped = dpo_terms(pr, pc, rr, rc, 0.5)["loss"]  # chosen and rejected swapped
    smoothed = dpo_terms(pc, pr, rc, rr, 0.5, label_smoothing=eps)["loss"]
    assert torch.allclose(smoothed, (1 - eps) * plain + eps * flipped)
    # At eps = 0.5 the labels carry no information: swapping them changes nothing.
    half = dpo_terms(pc, pr, rc, rr, 0.5, label_smoothing=0.5)["loss"]
    assert torch.allclose(half, dpo_terms(pr, pc, rr, rc, 0.5, label_smoothing=0.5)["loss"])


def test_ipo_is_minimal_where_the_margin_is_one_over_two_beta():
    beta = 0.25
    rc, rr = torch.tensor([-3.0]), torch.tensor([-6.0])
    margins = torch.linspace(-4, 8, 241)
    losses = torch.stack([dpo_terms(rc + m, rr, rc, rr, beta, "ipo")["loss"][0] for m in margins])
    best = margins[losses.argmin()]
    assert abs(float(best) - 1 / (2 * beta)) < 0.051
    assert float(losses.min()) < 1e-4
    # Unlike the sigmoid loss, pushing the margin further is penalised.
    assert float(losses[-1]) > float(losses.min())


def test_dpo_depends_only_on_log_ratios():
    pc, pr, rc, rr = _seq_inputs(3)
    shift = torch.tensor([1.5, -2.0, 0.5, 3.0, -1.0, 0.25], dtype=torch.float64)
    a, _ = dpo_loss(pc, pr, rc, rr, 0.3)
    b, _ = dpo_loss(pc + shift, pr, rc + shift, rr, 0.3)
    assert abs(float(a) - float(b)) < 1e-12


def test_dpo_rejects_an_unknown_loss_type_and_leaves_inputs_alone():
    pc, pr, rc, rr = _seq_inputs(1)
    before = [t.clone() for t in (pc, pr, rc, rr)]
    dpo_loss(pc, pr, rc, rr, 0.1, "sigmoid", 0.1)
    assert all(torch.equal(x, y) for x, y in zip((pc, pr, rc, rr), before))
    with pytest.raises(ValueError, match="loss_type"):
        dpo_terms(pc, pr, rc, rr, 0.1, "hinge")


# ---------------------------------------------------------------------------------------------
# KTO
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.0, 1.33), (0.5, 2.0)])
def test_kto_matches_float64_reference(seed, weights):
    g = torch.Generator().manual_seed(seed)
    lp, ref, kl_lp, kl_ref = (
        -10 * torch.rand(8, generator=g, dtype=torch.float64) for _ in range(4)
    )
    desirable = torch.rand(8, generator=g) > 0.4
    loss, stats = kto_loss(lp, ref, desirable, kl_lp, kl_ref, 0.2, *weights)
    want, z0 = ref_kto(
        lp.tolist(),
        ref.tolist(),
        desirable.tolist(),
        kl_lp.tolist(),
        kl_ref.tolist(),
        0.2,
        *weights,
    )
    assert abs(float(loss) - want) < 1e-9
    assert abs(float(stats["kl"]) - z0) < 1e-12
    r = 0.2 * (lp - ref)
    assert torch.allclose(stats["desirable_rewards"], r[desirable].mean())
    assert torch.allclose(stats["undesirable_rewards"], r[~desirable].mean())


def test_kto_reference_point_is_clamped_and_detached():
    logratio = torch.tensor([-3.0, 1.0], requires_grad=True)
    z0 = kto_reference_point(logratio.sum(), 2)
    assert float(z0) == 0.0 and not z0.requires_grad
    z0 = kto_reference_point((logratio + 4).sum(), 2)
    assert float(z0) == 3.0 and not z0.requires_grad


def test_kto_loss_bounds_gradient_direction_and_no_gradient_through_z0():
    lp = torch.tensor([-4.0, -6.0, -5.0, -7.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-5.0, -5.0, -5.0, -5.0], dtype=torch.float64)
    desirable = torch.tensor([True, True, False, False])
    kl_lp = torch.tensor([-2.0, -3.0], dtype=torch.float64, requires_grad=True)
    kl_ref = torch.tensor([-3.0, -3.5], dtype=torch.float64)
    loss, stats = kto_loss(lp, ref, desirable, kl_lp, kl_ref, 0.5, 2.0, 3.0)
    terms = kto_terms(lp, ref, desirable, stats["kl"], 0.5, 2.0, 3.0)["loss"]
    assert (terms >= 0).all() and (terms[:2] <= 2.0).all() and (terms[2:] <= 3.0).all()
    loss.backward()
    # Raising a desirable completion's log-prob lowers the loss; an undesirable one's raises it.
    assert (lp.grad[:2] < 0).all() and (lp.grad[2:] > 0).all()
    assert kl_lp.grad is None, "z0 must be detached (no gradient into the mismatched pairs)"


def test_kto_weights_scale_each_class():
    lp, ref = torch.tensor([-4.0, -6.0]), torch.tensor([-5.0, -5.0])
    desirable = torch.tensor([True, False])
    z0 = torch.tensor(0.3)
    base = kto_terms(lp, ref, desirable, z0, 0.1)["loss"]
    scaled = kto_terms(lp, ref, desirable, z0, 0.1, 2.0, 0.5)["loss"]
    assert torch.allclose(scaled, base * torch.tensor([2.0, 0.5]))


# ---------------------------------------------------------------------------------------------
# SimPO and ORPO (reference-free)
# ---------------------------------------------------------------------------------------------


def ref_simpo(pc, pr, lc, lr, beta, gamma, eps):
    """Mean loss and mean chosen/rejected rewards, one pair at a time."""
    loss = chosen = rejected = 0.0
    for i in range(len(pc)):
        rc, rr = beta * pc[i] / lc[i], beta * pr[i] / lr[i]
        z = rc - rr - gamma
        loss += -(1 - eps) * _log_sigmoid(z) - eps * _log_sigmoid(-z)
        chosen, rejected = chosen + rc, rejected + rr
    n = len(pc)
    return loss / n, chosen / n, rejected / n


def ref_orpo(pc, pr, lc, lr, lam, nll_sum, nll_tokens):
    """Mean loss and mean log odds ratio, with odds = p / (1 - p) written out directly."""
    loss = ratio = 0.0
    for i in range(len(pc)):
        p_w, p_l = math.exp(pc[i] / lc[i]), math.exp(pr[i] / lr[i])
        r = math.log(p_w / (1 - p_w)) - math.log(p_l / (1 - p_l))
        loss += -lam * _log_sigmoid(r)
        ratio += r
    n = len(pc)
    return nll_sum / nll_tokens + loss / n, ratio / n


def _free_inputs(seed, n=6):
    """Sequence log-prob sums and response lengths: per-token means in [-3, -0.05]."""
    g = torch.Generator().manual_seed(seed)
    lengths = [torch.randint(1, 12, (n,), generator=g).double() for _ in range(2)]
    means = [-0.05 - 3 * torch.rand(n, generator=g, dtype=torch.float64) for _ in range(2)]
    return means[0] * lengths[0], means[1] * lengths[1], lengths[0], lengths[1]


def test_simpo_hand_computed():
    # Chosen: sum -6 over 3 tokens (mean -2); rejected: -12 over 4 (mean -3). beta 2, gamma
    # 0.5: z = 2 (-2) - 2 (-3) - 0.5 = 1.5, loss = log(1 + e^-1.5) = 0.2014132779827524.
    pc, pr = torch.tensor([-6.0], dtype=torch.float64), torch.tensor([-12.0], dtype=torch.float64)
    lc, lr = torch.tensor([3]), torch.tensor([4])
    loss, stats = simpo_loss(pc, pr, lc, lr, beta=2.0, margin=0.5)
    assert abs(float(loss) - 0.2014132779827524) < 1e-12
    assert float(stats["chosen_rewards"]) == -4.0 and float(stats["rejected_rewards"]) == -6.0
    assert float(stats["margins"]) == 2.0 and float(stats["accuracy"]) == 1.0


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("beta,gamma,eps", [(2.0, 0.5, 0.0), (2.5, 1.4, 0.0), (0.1, 0.0, 0.2)])
def test_simpo_matches_float64_reference(seed, beta, gamma, eps):
    pc, pr, lc, lr = _free_inputs(seed)
    loss, stats = simpo_loss(pc, pr, lc, lr, beta, gamma, eps)
    want = ref_simpo(pc.tolist(), pr.tolist(), lc.tolist(), lr.tolist(), beta, gamma, eps)
    for got, w in zip((loss, stats["chosen_rewards"], stats["rejected_rewards"]), want):
        assert got.dim() == 0 and abs(float(got) - w) < 1e-12, (float(got), w)
    terms = simpo_terms(pc, pr, lc, lr, beta, gamma, eps)
    assert terms["loss"].shape == (6,) and torch.allclose(terms["loss"].mean(), loss)


def test_simpo_depends_on_per_token_means_only():
    """The same mean log-prob shift on both answers, or a response repeated k times (sum and
    length both x k), leaves the loss unchanged: SimPO's rewards are length-normalised."""
    pc, pr, lc, lr = _free_inputs(4)
    base = simpo_terms(pc, pr, lc, lr, 2.0, 0.7)["loss"]
    c = torch.tensor([0.3, -1.0, 2.0, 0.0, -0.4, 1.1], dtype=torch.float64)
    shifted = simpo_terms(pc + c * lc, pr + c * lr, lc, lr, 2.0, 0.7)["loss"]
    assert torch.allclose(shifted, base, atol=1e-12)
    assert torch.allclose(simpo_terms(3 * pc, pr, 3 * lc, lr, 2.0, 0.7)["loss"], base, atol=1e-12)
    # With unit lengths, no margin and a zero reference it is DPO's sigmoid loss.
    ones, zeros = torch.ones(6, dtype=torch.float64), torch.zeros(6, dtype=torch.float64)
    dpo = dpo_terms(pc, pr, zeros, zeros, 0.3)["loss"]
    assert torch.allclose(simpo_terms(pc, pr, ones, ones, 0.3, 0.0)["loss"], dpo, atol=1e-12)


def test_simpo_is_monotone_in_the_margin_and_its_gradient_favours_chosen():
    margins = torch.linspace(-20, 20, 81, dtype=torch.float64)
    one = torch.ones(81, dtype=torch.float64)
    losses = simpo_terms(margins, torch.zeros(81, dtype=torch.float64), one, one, 1.0, 0.5)["loss"]
    assert (losses[1:] < losses[:-1]).all(), "a larger chosen reward always lowers the loss"
    # At z = 0 (margin == gamma) the loss is log 2.
    z0 = simpo_terms(
        torch.tensor([0.5]), torch.tensor([0.0]), torch.ones(1), torch.ones(1), 1.0, 0.5
    )
    assert abs(float(z0["loss"][0]) - math.log(2)) < 1e-6
    pc, pr, lc, lr = (t.clone().requires_grad_(i < 2) for i, t in enumerate(_free_inputs(2)))
    simpo_loss(pc, pr, lc, lr, 2.0, 0.5)[0].backward()
    assert (pc.grad < 0).all() and (pr.grad > 0).all()
    # d loss / d sum = -beta sigmoid(-z) / (B |y|): a token of a long answer counts for less.
    assert torch.allclose(-pc.grad * lc, pr.grad * lr)


def test_log_odds_is_exact_near_certainty_and_finite_at_it():
    for dtype in (torch.float32, torch.float64):
        x = torch.tensor([-1e-10, -1e-4, -0.5, -0.7, -5.0, -80.0], dtype=dtype)
        want = [v - math.log(-math.expm1(v)) for v in x.tolist()]
        got = log_odds(x)
        atol = 1e-6 if dtype == torch.float32 else 1e-12  # x - log(1 - p) cancels near -log 2
        want = torch.tensor(want, dtype=torch.float64)
        assert torch.allclose(got.double(), want, rtol=1e-6, atol=atol)
        at_one = log_odds(torch.zeros(2, dtype=dtype))  # p = 1: clamped, large and finite
        assert torch.isfinite(at_one).all() and (at_one > 80).all()


def test_orpo_hand_computed():
    # Chosen: 2 tokens of p = 0.5 (odds 1); rejected: 3 tokens of p = 0.2 (odds 1/4). Log odds
    # ratio log 4; L_OR = -log sigmoid(log 4) = log(5/4). NLL: 2 log 2 over 2 tokens = log 2.
    pc = torch.tensor([2 * math.log(0.5)], dtype=torch.float64)
    pr = torch.tensor([3 * math.log(0.2)], dtype=torch.float64)
    lc, lr = torch.tensor([2]), torch.tensor([3])
    terms = orpo_terms(pc, pr, lc, lr, or_weight=0.1)
    assert abs(float(terms["log_odds_ratio"][0]) - math.log(4)) < 1e-12
    assert abs(float(terms["loss"][0]) - 0.1 * math.log(1.25)) < 1e-12
    loss, stats = orpo_loss(pc, pr, lc, lr, 0.1, -pc.sum(), 2)
    assert abs(float(loss) - (math.log(2) + 0.1 * math.log(1.25))) < 1e-12
    assert abs(float(stats["nll"]) - math.log(2)) < 1e-12
    assert abs(float(stats["chosen_rewards"]) - 0.1 * math.log(0.5)) < 1e-12
    assert float(stats["accuracy"]) == 1.0


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("lam", [0.1, 1.0])
def test_orpo_matches_float64_reference(seed, lam):
    pc, pr, lc, lr = _free_inputs(seed)
    nll_sum, nll_tokens = -pc.sum() + 3.5, lc.sum() + 4  # e.g. prompt tokens too
    loss, stats = orpo_loss(pc, pr, lc, lr, lam, nll_sum, nll_tokens)
    want, ratio = ref_orpo(pc.tolist(), pr.tolist(), lc.tolist(), lr.tolist(), lam,
                           float(nll_sum), float(nll_tokens))  # fmt: skip
    assert abs(float(loss) - want) < 1e-12 and abs(float(stats["log_odds_ratio"]) - ratio) < 1e-12


def test_orpo_odds_ratio_term_is_monotone_and_antisymmetric():
    pc, pr, lc, lr = _free_inputs(5)
    forward = orpo_terms(pc, pr, lc, lr, 1.0)
    swapped = orpo_terms(pr, pc, lr, lc, 1.0)
    # -log sigmoid(r) + log sigmoid(-r) = -r: swapping the labels moves the loss by the ratio.
    assert torch.allclose(forward["loss"] - swapped["loss"], -forward["log_odds_ratio"])
    means = torch.linspace(-6, -0.01, 60, dtype=torch.float64)
    one, rejected = (
        torch.ones(60, dtype=torch.float64),
        torch.full((60,), -1.0, dtype=torch.float64),
    )
    up = orpo_terms(means, rejected, one, one, 1.0)["loss"]
    assert (up[1:] < up[:-1]).all(), "a likelier chosen answer lowers the loss"
    down = orpo_terms(rejected, means, one, one, 1.0)["loss"]
    assert (down[1:] > down[:-1]).all(), "a likelier rejected answer raises it"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reference_free_losses_and_gradients_are_finite_for_extreme_inputs(dtype):
    # Per-token means from certainty (0) to hopeless (-1e4), lengths 1 to 4096, and an empty
    # response (length 0, sum 0).
    pc = torch.tensor([0.0, -1e-9, -3.0, -4e7, 0.0, -2.0], dtype=dtype, requires_grad=True)
    pr = torch.tensor([0.0, -5e3, -1e-12, 0.0, -1e4, 0.0], dtype=dtype, requires_grad=True)
    lc, lr = torch.tensor([1, 7, 3, 4096, 1, 2]), torch.tensor([2, 1, 9, 1, 1, 0])
    for loss, _ in (
        simpo_loss(pc, pr, lc, lr, 10.0, 3.0, 0.1),
        orpo_loss(pc, pr, lc, lr, 0.5, -pc.sum(), lc.sum()),
    ):
        pc.grad = pr.grad = None
        loss.backward()
        assert (
            torch.isfinite(loss) and torch.isfinite(pc.grad).all() and torch.isfinite(pr.grad).all()
        )


def test_reference_free_losses_leave_inputs_alone():
    pc, pr, lc, lr = _free_inputs(8)
    before = [t.clone() for t in (pc, pr, lc, lr)]
    simpo_loss(pc, pr, lc, lr, 2.0, 0.5, 0.1)
    orpo_loss(pc, pr, lc, lr, 0.1, -pc.sum(), lc.sum())
    assert all(torch.equal(x, y) for x, y in zip((pc, pr, lc, lr), before))


# ---------------------------------------------------------------------------------------------
# Online DPO's pairs: each group's best against its worst sample, ties skipped
# ---------------------------------------------------------------------------------------------


def test_best_worst_pairs_hand_computed():
    # groups of 4: [1, 3, 3, 0] -> chosen row 1 (the first of the two 3s), rejected row 3;
    # [2, 2, 2, 2] ties; [-1, nan, 4, 0] has no order (NaN) and is skipped; [0.5, -2, 7, -2]
    # -> chosen 14, rejected 13 (the first of the two -2s)
    nan = float("nan")
    scores = torch.tensor([1, 3, 3, 0, 2, 2, 2, 2, -1, nan, 4, 0, 0.5, -2, 7, -2])
    chosen, rejected, valid = best_worst_pairs(scores, 4)
    assert valid.tolist() == [True, False, False, True]
    assert chosen.tolist() == [1, 4, 8, 14] and rejected.tolist() == [3, 4, 8, 13]
    # pairs of 2 (TRL's default): a tie is skipped, not "first wins"
    chosen, rejected, valid = best_worst_pairs(torch.tensor([0.0, 1.0, 2.0, 2.0]), 2)
    assert (chosen.tolist(), rejected.tolist(), valid.tolist()) == ([1, 2], [0, 2], [True, False])


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("n", [2, 3, 5])
def test_best_worst_pairs_properties(seed, n):
    g = torch.Generator().manual_seed(seed)
    G = 40
    # few distinct values, so ties (within and across groups) are common
    scores = torch.randint(0, 3, (G * n,), generator=g).double()
    before = scores.clone()
    chosen, rejected, valid = best_worst_pairs(scores, n)
    assert torch.equal(scores, before)  # the input is left alone
    for k in range(G):
        group = scores[k * n : (k + 1) * n].tolist()
        assert bool(valid[k]) == (max(group) > min(group))  # a pair iff not all tie
        if valid[k]:
            c, r = int(chosen[k]) - k * n, int(rejected[k]) - k * n
            assert 0 <= c < n and 0 <= r < n and c != r  # rows of its own group
            assert group[c] == max(group) and group[r] == min(group)
            assert group.index(max(group)) == c and group.index(min(group)) == r
    # the pairs follow the rows they name: shuffling rows within groups moves them along
    perm = torch.cat([torch.randperm(n, generator=g) + k * n for k in range(G)])
    c2, r2, v2 = best_worst_pairs(scores[perm], n)
    assert torch.equal(v2, valid)
    assert torch.equal(scores[perm][c2[v2]], scores[chosen[valid]])
    assert torch.equal(scores[perm][r2[v2]], scores[rejected[valid]])
    # any strictly increasing map of the scores gives the same pairs (a ranking only)
    assert all(torch.equal(a, b) for a, b in zip(best_worst_pairs(scores.exp() * 3 - 1, n),
                                                 (chosen, rejected, valid)))  # fmt: skip


def test_best_worst_pairs_refuses_rows_that_are_not_groups():
    with pytest.raises(ValueError, match="groups of 3"):
        best_worst_pairs(torch.zeros(7), 3)
    with pytest.raises(ValueError, match="groups of 1"):
        best_worst_pairs(torch.zeros(4), 1)
