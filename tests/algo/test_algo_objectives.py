"""Tests for rlhf_dist.algo.objectives: GSPO's sequence ratio, CISPO's loss, DAPO's overlong
penalty and mask, and the dynamic-sampling filter (docs/algorithms.md)."""

import math

import pytest
import torch

from rlhf_dist.algo.estimators import AdvantageInputs, grpo_estimator, rloo_estimator
from rlhf_dist.algo.losses import aggregate_loss
from rlhf_dist.algo.objectives import (
    drop_truncated,
    dynamic_sampling_selection,
    overlong_penalty,
    sequence_log_ratio,
    tied_groups,
)
from rlhf_dist.algo.policy_losses import cispo_terms, ppo_policy_terms

SEEDS = [0, 1, 2]
LN = math.log


def _inputs(seed, B=5, T=6, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([T, 1, 3, 0, 5][:B])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    lp = -torch.rand(B, T, generator=g, dtype=dtype) * 2
    old = lp + 0.3 * torch.randn(B, T, generator=g, dtype=dtype)
    adv = torch.randn(B, generator=g, dtype=dtype)[:, None].expand(B, T).clone()
    return lp, old, adv, mask


# ------------------------------------------------------------------------------------ GSPO


def test_sequence_log_ratio_hand_computed():
    lp = torch.tensor([[-1.0, -2.0, -9.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
    old = torch.tensor([[-1.5, -1.5, 0.0], [-2.0, -1.0, -1.3]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    leaf = lp.clone().requires_grad_(True)
    out = sequence_log_ratio(leaf, old, mask)
    # row 0: (0.5 - 0.5) / 2 = 0; row 1: (1 + 0 + 0.3) / 3; every position holds its row's value
    want = torch.tensor([[0.0] * 3, [1.3 / 3] * 3], dtype=torch.float64)
    assert torch.allclose(out, want)
    # GSPO-token: d log s_i,t / d logprobs_t' = 1 if t' == t else 0
    out[1, 2].backward()
    assert torch.equal(leaf.grad, torch.tensor([[0.0] * 3, [0.0, 0.0, 1.0]], dtype=torch.float64))


def _gspo_reference_loss(lp, old, adv, mask, eps):
    """GSPO's sequence objective (Zheng et al. 2025, eq. 5) in plain autograd: per row
    s_i = exp(mean_t (lp - old)), loss_i = max(-A_i s_i, -A_i clip(s_i)), mean over rows
    (a row without tokens adds 0 and counts as a row, as the aggregation's contract says)."""
    rows = []
    for b in range(lp.shape[0]):
        m = mask[b]
        n = int(m.sum())
        if n == 0:
            rows.append(torch.zeros((), dtype=lp.dtype))
            continue
        s = torch.exp((lp[b][m] - old[b][m]).sum() / n)
        a = adv[b, 0]
        rows.append(torch.maximum(-a * s, -a * s.clamp(1 - eps, 1 + eps)))
    return torch.stack(rows).mean()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("eps", [0.05, 0.2, float("inf")])
def test_gspo_token_equals_the_sequence_objective_in_value_and_gradient(seed, eps):
    lp, old, adv, mask = _inputs(seed)
    a = lp.clone().requires_grad_(True)
    terms = ppo_policy_terms(a, old, adv, eps, log_ratio=sequence_log_ratio(a, old, mask))
    ours = aggregate_loss(terms["loss"], mask, "seq_mean_token_mean")
    ours.backward()
    b = lp.clone().requires_grad_(True)
    ref = _gspo_reference_loss(b, old, adv, mask, eps)
    ref.backward()
    assert torch.allclose(ours, ref)
    assert torch.allclose(a.grad, b.grad)
    assert a.grad[~mask].abs().sum() == 0
    if eps == float("inf"):  # nothing clipped: every real token has a gradient
        assert (a.grad[mask] != 0).all()


@pytest.mark.parametrize("seed", SEEDS)
def test_gspo_equals_token_ppo_at_ratio_one(seed):
    lp, _, adv, mask = _inputs(seed)
    adv = torch.randn(adv.shape, generator=torch.Generator().manual_seed(seed), dtype=adv.dtype)
    a, b = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
    old = lp.detach()
    gspo = ppo_policy_terms(a, old, adv, 0.2, log_ratio=sequence_log_ratio(a, old, mask))
    token = ppo_policy_terms(b, old, adv, 0.2)
    aggregate_loss(gspo["loss"], mask, "token_mean").backward()
    aggregate_loss(token["loss"], mask, "token_mean").backward()
    assert torch.allclose(gspo["loss"], token["loss"]) and torch.allclose(a.grad, b.grad)


@pytest.mark.parametrize("seed", SEEDS)
def test_sequence_ratio_is_row_local_and_ignores_padding(seed):
    """Split invariance: a row's ratio depends on that row only, not on other rows or on
    the values at padded positions."""
    lp, old, _, mask = _inputs(seed)
    full = sequence_log_ratio(lp, old, mask)
    junk = torch.where(mask, lp, 50.0), torch.where(mask, old, -70.0)
    assert torch.allclose(sequence_log_ratio(*junk, mask), full)
    for rows in (slice(0, 2), slice(2, 5)):
        assert torch.equal(sequence_log_ratio(lp[rows], old[rows], mask[rows]), full[rows])
    assert torch.equal(full[3], torch.zeros_like(full[3]))  # a row without tokens


def test_gspo_clips_a_whole_row():
    """Every token of a row shares s_i: when s_i leaves the clip range with the advantage
    pushing it further, no token of that row gets a gradient."""
    lp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.5, -1.2], [-1.0, -1.1]], dtype=torch.float64)  # s_0 = e^0.35
    adv = torch.ones(2, 2, dtype=torch.float64)
    mask = torch.ones(2, 2, dtype=torch.bool)
    terms = ppo_policy_terms(lp, old, adv, 0.2, log_ratio=sequence_log_ratio(lp, old, mask))
    terms["loss"].sum().backward()
    assert torch.equal(terms["clipped"][0], torch.ones(2, dtype=torch.float64))
    assert torch.equal(lp.grad[0], torch.zeros(2, dtype=torch.float64))
    assert (lp.grad[1] != 0).all()
    assert torch.allclose(terms["ratio"][0], torch.full((2,), math.exp(0.35), dtype=torch.float64))
    # approx_kl stays the per-token k2 of the token log-ratio
    assert torch.allclose(
        terms["approx_kl"][0], 0.5 * torch.tensor([0.5, 0.2], dtype=torch.float64) ** 2
    )


# ----------------------------------------------------------------------------------- CISPO


def test_cispo_hand_computed():
    lp = torch.tensor([[-0.5, -1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    old = lp.detach() - torch.tensor([[LN(1.5), LN(0.5), 0.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -2.0, 3.0]], dtype=torch.float64)
    terms = cispo_terms(lp, old, adv, 0.2, 0.28)
    # weights clip(1.5) = 1.28, clip(0.5) = 0.8, 1; loss = -w * A * logprobs
    assert torch.allclose(terms["loss"], torch.tensor([[0.64, -1.6, 6.0]], dtype=torch.float64))
    assert torch.equal(terms["clipped"], torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64))
    assert torch.allclose(terms["ratio"], torch.tensor([[1.5, 0.5, 1.0]], dtype=torch.float64))
    terms["loss"].sum().backward()
    # d loss / d logprobs = -w * A: clipped tokens keep a gradient (PPO's clip drops them)
    assert torch.allclose(lp.grad, torch.tensor([[-1.28, 1.6, -3.0]], dtype=torch.float64))


def test_cispo_without_a_lower_bound_and_without_clipping():
    lp = torch.zeros(1, 2, dtype=torch.float64)
    old = torch.tensor([[LN(4.0), -LN(3.0)]], dtype=torch.float64)  # r = 1/4, 3
    adv = torch.ones(1, 2, dtype=torch.float64)
    upper_only = (
        cispo_terms(lp - 1, old - 1, adv, 1.0, 0.5)["ratio"],
        cispo_terms(lp - 1, old - 1, adv, 1.0, 0.5)["clipped"],
    )
    assert torch.allclose(upper_only[0], torch.tensor([[0.25, 3.0]], dtype=torch.float64))
    assert torch.equal(upper_only[1], torch.tensor([[0.0, 1.0]], dtype=torch.float64))
    open_ = cispo_terms(lp - 1, old - 1, adv, float("inf"), float("inf"))
    assert torch.allclose(open_["loss"], torch.tensor([[0.25, 3.0]], dtype=torch.float64))
    assert open_["clipped"].sum() == 0


@pytest.mark.parametrize("seed", SEEDS)
def test_cispo_gradient_is_the_policy_gradient_at_ratio_one(seed):
    lp, _, _, mask = _inputs(seed)
    adv = torch.randn(lp.shape, generator=torch.Generator().manual_seed(seed), dtype=lp.dtype)
    a, b = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
    aggregate_loss(cispo_terms(a, lp, adv, 0.2, 0.2)["loss"], mask, "token_mean").backward()
    aggregate_loss(ppo_policy_terms(b, lp, adv, 0.2)["loss"], mask, "token_mean").backward()
    assert torch.allclose(a.grad, b.grad)


@pytest.mark.parametrize("seed", SEEDS)
def test_cispo_weights_every_token_by_its_bounded_ratio(seed):
    """The gradient is -w * A per token (divided by the count) with w in the clip range,
    never 0 where A != 0, and the weight itself carries no gradient."""
    lp, old, adv, mask = _inputs(seed)
    a = lp.clone().requires_grad_(True)
    terms = cispo_terms(a, old, adv, 0.2, 0.28)
    aggregate_loss(terms["loss"], mask, "token_mean").backward()
    w = torch.exp(lp - old).clamp(0.8, 1.28)
    want = torch.where(mask, -w * adv / mask.sum(), 0.0)
    assert torch.allclose(a.grad, want)
    assert (a.grad[mask] != 0).all()


@pytest.mark.parametrize("seed", SEEDS)
def test_cispo_with_the_sequence_ratio_weights_a_row_alike(seed):
    lp, old, adv, mask = _inputs(seed)
    terms = cispo_terms(lp, old, adv, 0.2, 0.28, log_ratio=sequence_log_ratio(lp, old, mask))
    s = torch.exp(sequence_log_ratio(lp, old, mask))[:, :1]
    assert torch.allclose(terms["ratio"], s.expand_as(lp))
    assert torch.allclose(terms["loss"], -s.clamp(0.8, 1.28) * adv * lp)


def test_objectives_do_not_modify_inputs():
    lp, old, adv, mask = _inputs(0)
    copies = [x.clone() for x in (lp, old, adv, mask)]
    sequence_log_ratio(lp, old, mask)
    cispo_terms(lp, old, adv, 0.2, 0.28)
    drop_truncated(mask, torch.tensor([True, False, True, True, False]))
    for x, c in zip((lp, old, adv, mask), copies):
        assert torch.equal(x, c)


# -------------------------------------------------------------------------------- overlong


def test_overlong_penalty_hand_computed():
    lengths = torch.tensor([10, 16, 17, 18, 20, 21])
    got = overlong_penalty(lengths, max_length=20, buffer=4)
    assert torch.allclose(got, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))


@pytest.mark.parametrize("max_length,buffer", [(24, 8), (10, 10), (7, 1)])
def test_overlong_penalty_is_monotone_bounded_and_continuous(max_length, buffer):
    y = torch.arange(0, max_length + 3, dtype=torch.float64)
    p = overlong_penalty(y, max_length, buffer)
    assert (p <= 0).all() and (p >= -1).all()
    assert (p[1:] <= p[:-1]).all()  # longer is never better
    assert (p[y <= max_length - buffer] == 0).all() and (p[y >= max_length] == -1).all()
    steps = (p[1:] - p[:-1]).abs()
    assert steps.max() <= 1.0 / buffer + 1e-12  # no jump at either end of the buffer


@pytest.mark.parametrize("buffer", [0, -1, 25])
def test_overlong_penalty_rejects_a_bad_buffer(buffer):
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(torch.tensor([3]), 24, buffer)


def test_drop_truncated_hand_computed():
    mask = torch.tensor([[True, True, False], [True, True, True], [True, False, False]])
    got = drop_truncated(mask, torch.tensor([True, False, True]))
    assert torch.equal(got, torch.tensor([[True, True, False], [False] * 3, [True, False, False]]))


# ------------------------------------------------------------------------ dynamic sampling


def test_tied_groups_hand_computed():
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.5, 0.5, 0.5, float("nan")] * 1)
    scores = torch.cat([scores, torch.tensor([float("nan"), float("nan")])])
    # groups of 3: [1,1,1] tie, [0,1,0] no, [0.5,0.5,0.5] tie, [nan,nan,nan] never ties
    assert torch.equal(tied_groups(scores, 3), torch.tensor([True, False, True, False]))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("estimator", [grpo_estimator, rloo_estimator])
def test_tied_groups_are_the_groups_without_advantage(seed, estimator):
    """Property: a tied group's samples get exactly zero group advantage, the others not."""
    g = torch.Generator().manual_seed(seed)
    n, G, T = 4, 6, 3
    scores = torch.randint(0, 2, (G * n,), generator=g).double()
    scores[:n] = 1.0  # at least one tied group
    scores[n : 2 * n] = torch.tensor([0.0, 1.0, 1.0, 0.0])  # and one that is not
    mask = torch.ones(G * n, T, dtype=torch.bool)
    rewards = torch.zeros(G * n, T, dtype=torch.float64)
    rewards[:, -1] = scores
    adv, _ = estimator(AdvantageInputs(rewards, scores, mask, group_size=n))
    no_signal = (adv.reshape(G, n * T) == 0).all(dim=1)
    assert torch.equal(tied_groups(scores, n), no_signal)


def test_tied_groups_rejects_a_partial_group():
    with pytest.raises(ValueError, match="groups of 4"):
        tied_groups(torch.zeros(6), 4)


def test_dynamic_sampling_selection_hand_computed():
    tied = torch.tensor([True, False, True, False, False, True])
    assert dynamic_sampling_selection(tied, 2).tolist() == [1, 3]
    assert dynamic_sampling_selection(tied, 3).tolist() == [1, 3, 4]
    assert dynamic_sampling_selection(tied, 5).tolist() == [1, 3, 4, 0, 2]  # topped up
    with pytest.raises(ValueError, match="cannot fill"):
        dynamic_sampling_selection(tied, 7)


@pytest.mark.parametrize("seed", SEEDS)
def test_dynamic_sampling_selection_prefers_untied_groups(seed):
    g = torch.Generator().manual_seed(seed)
    tied = torch.rand(20, generator=g) < 0.6
    for target in (1, 5, 10, 20):
        pick = dynamic_sampling_selection(tied, target)
        assert pick.numel() == target == len(set(pick.tolist()))
        untied = int((~tied).sum())
        assert int(tied[pick].sum()) == max(0, target - untied)
        assert (~tied[pick[: min(target, untied)]]).all()
