"""Tests for rlhf_dist.algo.losses (ppo_policy_loss/terms incl. clip-higher and dual clip,
value_loss, pairwise_reward_loss, loss aggregation modes)."""

import math
import random

import pytest
import torch

from rlhf_dist.algo.losses import (
    LOSS_AGGREGATIONS,
    aggregate_loss,
    aggregation_count,
    aggregation_weights,
    pairwise_reward_loss,
    pairwise_reward_terms,
    ppo_policy_loss,
    ppo_policy_terms,
    value_loss,
)
from rlhf_dist.algo.masking import masked_sum

SEEDS = [0, 1, 2, 3]
LN = math.log


# ---------------------------------------------------------------------------------------------
# float64 references: loops over batch and time; one masked mean over the whole batch.
# ---------------------------------------------------------------------------------------------


def ref_ppo_policy_loss(logprobs, old_logprobs, advantages, mask, clip_eps):
    lp, old, a, m = logprobs.tolist(), old_logprobs.tolist(), advantages.tolist(), mask.tolist()
    total, count = 0.0, 0
    for b in range(len(lp)):
        for t in range(len(lp[0])):
            if not m[b][t]:
                continue
            ratio = math.exp(lp[b][t] - old[b][t])
            clipped = min(max(ratio, 1.0 - clip_eps), 1.0 + clip_eps)
            total += max(-a[b][t] * ratio, -a[b][t] * clipped)
            count += 1
    return total / count


def ref_value_loss(values, old_values, returns, mask, clip_eps=None):
    v, old, r, m = values.tolist(), old_values.tolist(), returns.tolist(), mask.tolist()
    total, count = 0.0, 0
    for b in range(len(v)):
        for t in range(len(v[0])):
            if not m[b][t]:
                continue
            err = (v[b][t] - r[b][t]) ** 2
            if clip_eps is not None:
                v_clip = old[b][t] + min(max(v[b][t] - old[b][t], -clip_eps), clip_eps)
                err = max(err, (v_clip - r[b][t]) ** 2)
            total += err
            count += 1
    return 0.5 * total / count


def ref_pairwise(chosen, rejected, margin=None):
    c, r = chosen.tolist(), rejected.tolist()
    if margin is None:
        mg = [0.0] * len(c)
    elif isinstance(margin, float):
        mg = [margin] * len(c)
    else:
        mg = margin.tolist()
    loss, correct = 0.0, 0
    for i in range(len(c)):
        z = c[i] - r[i] - mg[i]
        loss += math.log1p(math.exp(-z))  # -logsigmoid(z) = log(1 + e^-z)
        correct += 1 if c[i] > r[i] else 0  # ties are not correct
    return loss / len(c), correct / len(c)


def _f(x) -> float:
    """Accept a float or a 0-dim tensor (the contract allows either for stats)."""
    if isinstance(x, torch.Tensor):
        assert x.dim() == 0, f"expected a 0-dim tensor, got shape {tuple(x.shape)}"
    return float(x)


def _scalar_loss(loss) -> float:
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0
    return float(loss)


def _policy_inputs(batch, length, seed):
    g = torch.Generator().manual_seed(900 + seed)
    old = -3.0 * torch.rand(batch, length, generator=g, dtype=torch.float64)
    # log-ratios up to ~+-0.6 so a good share of tokens falls outside [1-eps, 1+eps]
    lp = old + 0.3 * torch.randn(batch, length, generator=g, dtype=torch.float64)
    adv = torch.randn(batch, length, generator=g, dtype=torch.float64)
    return lp, old, adv


def _value_inputs(batch, length, seed):
    g = torch.Generator().manual_seed(1100 + seed)
    old = torch.randn(batch, length, generator=g, dtype=torch.float64)
    values = old + 0.4 * torch.randn(batch, length, generator=g, dtype=torch.float64)
    returns = torch.randn(batch, length, generator=g, dtype=torch.float64)
    return values, old, returns


# ---------------------------------------------------------------------------------------------
# ppo_policy_loss
# ---------------------------------------------------------------------------------------------


def test_ppo_policy_loss_hand_computed():
    # clip_eps = 0.2; log-ratios chosen so ratio = 1.5, 0.5, 1.1 on the 3 real tokens; the 4th
    # token is padding with a huge ratio and advantage that must not count.
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0]], dtype=torch.float64)
    lp = old + torch.tensor([[LN(1.5), LN(0.5), LN(1.1), 3.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, -2.0, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False]])
    # token0: A=1,  r=1.5: -A*r = -1.5, -A*clip(r)=-1.2 -> max -1.2 (clip active)
    # token1: A=1,  r=0.5: -0.5,        -A*0.8 = -0.8   -> max -0.5 (clip inactive)
    # token2: A=-2, r=1.1: 2.2,          2.2 (in range) -> 2.2
    # loss = (-1.2 - 0.5 + 2.2) / 3 = 0.5 / 3 = 0.1666...
    loss, stats = ppo_policy_loss(lp, old, adv, mask, 0.2)
    assert _scalar_loss(loss) == pytest.approx(0.5 / 3, abs=1e-12)
    assert 0.0 <= _f(stats["clipfrac"]) <= 1.0
    # approx_kl = mean(0.5 * d^2) over the 3 real tokens, which is > 0 here
    assert _f(stats["approx_kl"]) > 0


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("clip_eps", [0.1, 0.2])
def test_ppo_policy_loss_matches_reference(seed, clip_eps, ragged_mask):
    lp, old, adv = _policy_inputs(6, 11, seed)
    mask = ragged_mask(6, 11, seed)
    loss, stats = ppo_policy_loss(lp, old, adv, mask, clip_eps)
    expected = ref_ppo_policy_loss(lp, old, adv, mask, clip_eps)
    assert _scalar_loss(loss) == pytest.approx(expected, abs=1e-6)
    assert 0.0 <= _f(stats["clipfrac"]) <= 1.0
    assert _f(stats["approx_kl"]) >= 0.0


def test_ppo_policy_loss_float32(ragged_mask):
    lp, old, adv = _policy_inputs(6, 11, 7)
    mask = ragged_mask(6, 11, 7)
    loss, _ = ppo_policy_loss(lp.float(), old.float(), adv.float(), mask, 0.2)
    assert float(loss) == pytest.approx(ref_ppo_policy_loss(lp, old, adv, mask, 0.2), abs=1e-5)


def test_ppo_at_ratio_one_is_minus_mean_advantage_and_stats_are_zero(ragged_mask):
    # ratio = 1 everywhere: loss = masked_mean(-A), nothing clipped, approx_kl = 0.
    lp, _, adv = _policy_inputs(6, 11, 3)
    mask = ragged_mask(6, 11, 3)
    loss, stats = ppo_policy_loss(lp, lp.clone(), adv, mask, 0.2)
    assert float(loss) == pytest.approx(-float(adv[mask].sum()) / int(mask.sum()), abs=1e-12)
    assert _f(stats["clipfrac"]) == 0.0
    assert _f(stats["approx_kl"]) == 0.0


def test_ppo_stats_ignore_masked_positions(ragged_mask):
    # Real tokens at ratio 1 (nothing to clip, zero KL); padding with wild ratios and
    # advantages. Neither clipfrac nor approx_kl may see the padding.
    _, old, adv = _policy_inputs(6, 11, 4)
    mask = ragged_mask(6, 11, 4)
    lp = torch.where(mask, old, old + 2.0)
    _, stats = ppo_policy_loss(lp, old, adv, mask, 0.2)
    assert _f(stats["clipfrac"]) == 0.0
    assert _f(stats["approx_kl"]) == 0.0


def test_ppo_clipfrac_is_one_when_every_real_token_is_clipped(ragged_mask):
    # A > 0 and ratio = e^0.5 = 1.65 > 1.2 on every real token: the clipped term is strictly
    # larger on all of them (clip active everywhere); padding sits at ratio 1, unclipped.
    _, old, _ = _policy_inputs(6, 11, 5)
    mask = ragged_mask(6, 11, 5)
    lp = torch.where(mask, old + 0.5, old)
    adv = torch.ones(6, 11, dtype=torch.float64)
    loss, stats = ppo_policy_loss(lp, old, adv, mask, 0.2)
    assert _f(stats["clipfrac"]) == pytest.approx(1.0, abs=1e-12)
    # every real token contributes -A*(1+eps) = -1.2
    assert float(loss) == pytest.approx(-1.2, abs=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
def test_ppo_approx_kl_ignores_padding_values(seed, ragged_mask):
    lp, old, adv = _policy_inputs(6, 11, seed)
    mask = ragged_mask(6, 11, seed)
    _, stats = ppo_policy_loss(lp, old, adv, mask, 0.2)
    lp2 = torch.where(mask, lp, lp + 1.5)
    loss2, stats2 = ppo_policy_loss(lp2, old, adv, mask, 0.2)
    assert _f(stats2["approx_kl"]) == pytest.approx(_f(stats["approx_kl"]), abs=1e-12)
    assert _f(stats2["clipfrac"]) == pytest.approx(_f(stats["clipfrac"]), abs=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
def test_ppo_policy_loss_invariant_to_padding_columns(seed, ragged_mask, pad_columns):
    lp, old, adv = _policy_inputs(6, 11, seed)
    mask = ragged_mask(6, 11, seed)
    loss, stats = ppo_policy_loss(lp, old, adv, mask, 0.2)
    (lp_p, old_p, adv_p), mask_p = pad_columns([lp, old, adv], mask, 4, seed)
    loss_p, stats_p = ppo_policy_loss(lp_p, old_p, adv_p, mask_p, 0.2)
    assert float(loss_p) == pytest.approx(float(loss), abs=1e-12)
    assert _f(stats_p["clipfrac"]) == pytest.approx(_f(stats["clipfrac"]), abs=1e-12)
    assert _f(stats_p["approx_kl"]) == pytest.approx(_f(stats["approx_kl"]), abs=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
def test_ppo_gradient_is_zero_at_masked_positions(seed, ragged_mask):
    lp, old, adv = _policy_inputs(6, 11, seed)
    mask = ragged_mask(6, 11, seed)
    lp = lp.clone().requires_grad_(True)
    loss, _ = ppo_policy_loss(lp, old, adv, mask, 0.2)
    loss.backward()
    assert lp.grad is not None
    assert torch.all(lp.grad[~mask] == 0)
    # and the real tokens do get a gradient (ratios near 1 are mostly unclipped)
    assert lp.grad[mask].abs().sum() > 0
    # Analytic check on unclipped tokens: d/dlp of -A*exp(lp-old)/N is -A*ratio/N.
    ratio = (lp.detach() - old).exp()
    unclipped = mask & ((ratio - 1.0).abs() < 0.2 - 1e-6)
    n = int(mask.sum())
    torch.testing.assert_close(
        lp.grad[unclipped], (-adv * ratio / n)[unclipped], atol=1e-12, rtol=1e-9
    )


# ---------------------------------------------------------------------------------------------
# value_loss
# ---------------------------------------------------------------------------------------------


def test_value_loss_hand_computed():
    values = torch.tensor([[1.0, 2.0, 0.0, 9.0]], dtype=torch.float64)
    old = torch.tensor([[0.5, 2.5, 0.0, 0.0]], dtype=torch.float64)
    returns = torch.tensor([[2.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False]])  # token 3 (V=9, R=0) is padding
    # unclipped: (V-R)^2 = 1, 1, 1 -> 0.5 * mean = 0.5
    loss, stats = value_loss(values, old, returns, mask)
    assert _scalar_loss(loss) == pytest.approx(0.5, abs=1e-12)
    # clip_eps = 0.2:
    #   token0: V-old = +0.5 -> +0.2, Vc = 0.7, (0.7-2)^2 = 1.69 > 1 -> 1.69
    #   token1: V-old = -0.5 -> -0.2, Vc = 2.3, (2.3-1)^2 = 1.69 > 1 -> 1.69
    #   token2: V-old = 0,            Vc = 0,   (0-1)^2   = 1         -> 1
    #   0.5 * (1.69 + 1.69 + 1) / 3 = 0.5 * 1.46 = 0.73
    loss, stats = value_loss(values, old, returns, mask, clip_eps=0.2)
    assert _scalar_loss(loss) == pytest.approx(0.73, abs=1e-12)
    assert 0.0 <= _f(stats["clipfrac"]) <= 1.0


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("clip_eps", [None, 0.1, 0.3])
def test_value_loss_matches_reference(seed, clip_eps, ragged_mask):
    values, old, returns = _value_inputs(6, 11, seed)
    mask = ragged_mask(6, 11, seed)
    loss, stats = value_loss(values, old, returns, mask, clip_eps=clip_eps)
    expected = ref_value_loss(values, old, returns, mask, clip_eps)
    assert _scalar_loss(loss) == pytest.approx(expected, abs=1e-6)
    assert 0.0 <= _f(stats["clipfrac"]) <= 1.0


def test_value_loss_float32(ragged_mask):
    values, old, returns = _value_inputs(6, 11, 7)
    mask = ragged_mask(6, 11, 7)
    loss, _ = value_loss(values.float(), old.float(), returns.float(), mask, clip_eps=0.2)
    expected = ref_value_loss(values, old, returns, mask, 0.2)
    assert float(loss) == pytest.approx(expected, abs=1e-5)


def test_value_clipfrac_is_zero_when_values_did_not_move(ragged_mask):
    values, _, returns = _value_inputs(6, 11, 2)
    mask = ragged_mask(6, 11, 2)
    _, stats = value_loss(values, values.clone(), returns, mask, clip_eps=0.2)
    assert _f(stats["clipfrac"]) == 0.0


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("clip_eps", [None, 0.2])
def test_value_loss_invariant_to_padding_columns(seed, clip_eps, ragged_mask, pad_columns):
    values, old, returns = _value_inputs(6, 11, seed)
    mask = ragged_mask(6, 11, seed)
    loss, stats = value_loss(values, old, returns, mask, clip_eps=clip_eps)
    (v_p, old_p, ret_p), mask_p = pad_columns([values, old, returns], mask, 4, seed)
    loss_p, stats_p = value_loss(v_p, old_p, ret_p, mask_p, clip_eps=clip_eps)
    assert float(loss_p) == pytest.approx(float(loss), abs=1e-12)
    assert _f(stats_p["clipfrac"]) == pytest.approx(_f(stats["clipfrac"]), abs=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("clip_eps", [None, 0.2])
def test_value_gradient_is_zero_at_masked_positions(seed, clip_eps, ragged_mask):
    values, old, returns = _value_inputs(6, 11, seed)
    mask = ragged_mask(6, 11, seed)
    values = values.clone().requires_grad_(True)
    loss, _ = value_loss(values, old, returns, mask, clip_eps=clip_eps)
    loss.backward()
    assert values.grad is not None
    assert torch.all(values.grad[~mask] == 0)
    assert values.grad[mask].abs().sum() > 0
    if clip_eps is None:
        # d/dV of 0.5*sum((V-R)^2)/N is (V-R)/N
        n = int(mask.sum())
        want = ((values.detach() - returns) / n)[mask]
        torch.testing.assert_close(values.grad[mask], want, atol=1e-12, rtol=1e-9)


# ---------------------------------------------------------------------------------------------
# pairwise_reward_loss
# ---------------------------------------------------------------------------------------------

_CHOSEN = torch.tensor([2.0, 0.0, 1.0], dtype=torch.float64)
_REJECTED = torch.tensor([0.0, 0.0, 3.0], dtype=torch.float64)


def test_pairwise_loss_hand_computed():
    # chosen - rejected = [2, 0, -2]; -logsigmoid(z) = log(1 + e^-z):
    #   log(1+e^-2) = 0.126928, log 2 = 0.693147, log(1+e^2) = 2.126928
    #   mean = 2.947003 / 3 = 0.982334
    # accuracy: 2 > 0 yes, 0 > 0 no (tie), 1 > 3 no -> 1/3
    loss, acc = pairwise_reward_loss(_CHOSEN, _REJECTED)
    assert _scalar_loss(loss) == pytest.approx(0.9823344008819634, abs=1e-9)
    assert _f(acc) == pytest.approx(1 / 3, abs=1e-12)


def test_pairwise_loss_margin_hand_computed():
    # float margin 1: z = [1, -1, -3] -> log(1+e^-1) + log(1+e^1) + log(1+e^3)
    #   = 0.313262 + 1.313262 + 3.048587 = 4.675111; / 3 = 1.558370
    loss, acc = pairwise_reward_loss(_CHOSEN, _REJECTED, margin=1.0)
    assert float(loss) == pytest.approx(1.5583702422033958, abs=1e-9)
    assert _f(acc) == pytest.approx(1 / 3, abs=1e-12)  # accuracy ignores the margin
    # tensor margin [0, 1, 2]: z = [2, -1, -4] -> 0.126928 + 1.313262 + 4.018150 = 5.458340
    #   / 3 = 1.819447
    margin = torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64)
    loss, acc = pairwise_reward_loss(_CHOSEN, _REJECTED, margin=margin)
    assert float(loss) == pytest.approx(1.8194465421596682, abs=1e-9)
    assert _f(acc) == pytest.approx(1 / 3, abs=1e-12)


def _pair_inputs(seed: int, n: int, scale: float, margin_kind: str):
    """(chosen, rejected, margin): n random scores each and a margin of the given kind."""
    g = torch.Generator().manual_seed(seed)
    chosen = scale * torch.randn(n, generator=g, dtype=torch.float64)
    rejected = scale * torch.randn(n, generator=g, dtype=torch.float64)
    margin = {
        "none": None,
        "float": 0.5,
        "tensor": torch.rand(n, generator=g, dtype=torch.float64),
    }[margin_kind]
    return chosen, rejected, margin


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("margin_kind", ["none", "float", "tensor"])
def test_pairwise_loss_matches_reference(seed, margin_kind):
    chosen, rejected, margin = _pair_inputs(1300 + seed, 16, 2.0, margin_kind)
    loss, acc = pairwise_reward_loss(chosen, rejected, margin=margin)
    exp_loss, exp_acc = ref_pairwise(chosen, rejected, margin)
    assert _scalar_loss(loss) == pytest.approx(exp_loss, abs=1e-6)
    assert _f(acc) == pytest.approx(exp_acc, abs=1e-12)


@pytest.mark.parametrize("margin", [0.7, "tensor"])
def test_pairwise_margin_equals_shifting(margin):
    g = torch.Generator().manual_seed(17)
    chosen = torch.randn(12, generator=g, dtype=torch.float64)
    rejected = torch.randn(12, generator=g, dtype=torch.float64)
    m = torch.rand(12, generator=g, dtype=torch.float64) if margin == "tensor" else margin
    loss_m, _ = pairwise_reward_loss(chosen, rejected, margin=m)
    loss_shift_c, _ = pairwise_reward_loss(chosen - m, rejected)
    loss_shift_r, _ = pairwise_reward_loss(chosen, rejected + m)
    assert float(loss_m) == pytest.approx(float(loss_shift_c), abs=1e-12)
    assert float(loss_m) == pytest.approx(float(loss_shift_r), abs=1e-12)


def test_pairwise_accuracy_counts_ties_as_wrong():
    scores = torch.tensor([0.3, -1.0, 2.0, 5.0], dtype=torch.float64)
    loss, acc = pairwise_reward_loss(scores, scores.clone())
    assert _f(acc) == 0.0
    assert float(loss) == pytest.approx(math.log(2.0), abs=1e-12)  # -logsigmoid(0) = ln 2


def test_pairwise_loss_is_stable_for_large_gaps():
    # -logsigmoid must not be computed as -log(sigmoid(z)): sigmoid(-200) underflows to 0 in
    # float32 and the loss would be inf. The right answer for z = -200 is ~200.
    chosen = torch.tensor([0.0, 200.0])
    rejected = torch.tensor([200.0, 0.0])
    loss, acc = pairwise_reward_loss(chosen, rejected)
    assert math.isfinite(float(loss))
    assert float(loss) == pytest.approx(100.0, rel=1e-5)  # (200 + ~0) / 2
    assert _f(acc) == 0.5


def test_pairwise_gradient_pushes_chosen_up_and_rejected_down():
    chosen = torch.tensor([0.1, -0.3, 1.0], dtype=torch.float64, requires_grad=True)
    rejected = torch.tensor([0.2, 0.5, -1.0], dtype=torch.float64, requires_grad=True)
    loss, _ = pairwise_reward_loss(chosen, rejected)
    loss.backward()
    # d/dc of mean softplus(-(c-r)) = -sigmoid(-(c-r))/B  (negative), and the opposite for r.
    want = -torch.sigmoid(-(chosen.detach() - rejected.detach())) / 3
    torch.testing.assert_close(chosen.grad, want, atol=1e-12, rtol=1e-9)
    torch.testing.assert_close(rejected.grad, -want, atol=1e-12, rtol=1e-9)


def test_pairwise_terms_hand_computed():
    # z = chosen - rejected - margin = [2, 0, -2] - 1 = [1, -1, -3]; -logsigmoid(z) =
    # log(1 + e^-z) = [0.313262, 1.313262, 3.048587]; summed 4.675111 (the RM trainer's
    # per-micro-batch SUM), whose mean is test_pairwise_loss_margin_hand_computed's 1.558370.
    terms = pairwise_reward_terms(_CHOSEN, _REJECTED, margin=1.0)
    assert terms.shape == (3,)
    want = [0.31326168751822286, 1.3132616875182228, 3.048587351573742]
    assert terms.tolist() == pytest.approx(want, abs=1e-12)
    assert float(terms.sum()) == pytest.approx(4.675110726610187, abs=1e-9)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("margin_kind", ["none", "float", "tensor"])
def test_pairwise_terms_are_positive_and_average_to_the_loss(seed, margin_kind):
    chosen, rejected, margin = _pair_inputs(1400 + seed, 10, 3.0, margin_kind)
    terms = pairwise_reward_terms(chosen, rejected, margin)
    loss, _ = pairwise_reward_loss(chosen, rejected, margin)
    assert torch.all(terms > 0)
    assert float(terms.mean()) == pytest.approx(float(loss), abs=1e-12)
    # Splitting the pairs in any way and summing the parts' terms gives the same total.
    parts = [
        pairwise_reward_terms(
            chosen[s], rejected[s], margin if margin_kind != "tensor" else margin[s]
        ).sum()
        for s in (slice(0, 3), slice(3, 10))
    ]
    assert float(sum(parts)) == pytest.approx(float(terms.sum()), abs=1e-12)
    # A larger gap in favour of the chosen response always costs less.
    assert torch.all(pairwise_reward_terms(chosen + 1.0, rejected, margin) < terms)


# ---------------------------------------------------------------------------------------------
# No input is modified
# ---------------------------------------------------------------------------------------------


def test_losses_do_not_modify_inputs(ragged_mask):
    lp, old, adv = _policy_inputs(6, 11, 6)
    values, old_v, returns = _value_inputs(6, 11, 6)
    mask = ragged_mask(6, 11, 6)
    chosen, rejected = lp[:, 0].clone(), old[:, 0].clone()
    margin = torch.full((6,), 0.25, dtype=torch.float64)
    tensors = (lp, old, adv, values, old_v, returns, mask, chosen, rejected, margin)
    originals = [t.clone() for t in tensors]
    ppo_policy_loss(lp, old, adv, mask, 0.2)
    value_loss(values, old_v, returns, mask)
    value_loss(values, old_v, returns, mask, clip_eps=0.2)
    pairwise_reward_loss(chosen, rejected)
    pairwise_reward_loss(chosen, rejected, margin=margin)
    pairwise_reward_terms(chosen, rejected, margin)
    for now, before in zip(tensors, originals, strict=True):
        assert torch.equal(now, before)


# ---------------------------------------------------------------------------------------------
# ppo_policy_terms: clip-higher (asymmetric bounds) and dual clip
# ---------------------------------------------------------------------------------------------


def ref_ppo_terms(logprobs, old_logprobs, advantages, clip_eps, clip_eps_high=None, dual_clip=None):
    """Per-token (loss, clipped, d loss / d logprob) as nested lists, a loop over every token.

    loss = max(-A r, -A clip(r, 1-low, 1+high)), then for A < 0 at most -c*A (dual clip).
    Where a clip decided the value the loss is a constant in logprobs (gradient 0), else it
    is -A r, whose derivative in logprobs is -A r.
    """
    high = clip_eps if clip_eps_high is None else clip_eps_high
    lp, old, adv = logprobs.tolist(), old_logprobs.tolist(), advantages.tolist()
    loss, cut, grad = [], [], []
    for b in range(len(lp)):
        loss.append([]), cut.append([]), grad.append([])
        for t in range(len(lp[0])):
            a = adv[b][t]
            ratio = math.exp(lp[b][t] - old[b][t])
            unclipped = -a * ratio
            clipped = -a * min(max(ratio, 1.0 - clip_eps), 1.0 + high)
            value, was_cut = max(unclipped, clipped), clipped > unclipped
            if dual_clip is not None and a < 0 and value > -dual_clip * a:
                value, was_cut = -dual_clip * a, True
            loss[b].append(value)
            cut[b].append(1.0 if was_cut else 0.0)
            grad[b].append(0.0 if was_cut else -a * ratio)
    return loss, cut, grad


def _ratio_logs(ratios):
    return torch.tensor([[LN(r) for r in ratios]], dtype=torch.float64)


def test_clip_higher_hand_computed():
    # clip_eps = 0.2 (lower bound 0.8), clip_eps_high = 0.28 (upper bound 1.28)
    #   tok  ratio   A    -A*r    -A*clip(r)       loss    clipped
    #   0    1.5    +1   -1.5    -1.28            -1.28    1   (above 1+high, A > 0)
    #   1    1.25   +1   -1.25   -1.25            -1.25    0   (in (1+low, 1+high]: NOT cut)
    #   2    0.7    +1   -0.7    -0.8             -0.7     0   (pessimistic: unclipped)
    #   3    0.75   -1    0.75    0.8              0.8     1   (lower bound is 1-clip_eps)
    #   4    1.5    -2    3.0     2.56             3.0     0
    #   5    1.1    +2   -2.2    -2.2             -2.2     0
    old = torch.full((1, 6), -1.0, dtype=torch.float64)
    lp = (old + _ratio_logs([1.5, 1.25, 0.7, 0.75, 1.5, 1.1])).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, 1.0, -1.0, -2.0, 2.0]], dtype=torch.float64)
    terms = ppo_policy_terms(lp, old, adv, 0.2, clip_eps_high=0.28)
    want = [-1.28, -1.25, -0.7, 0.8, 3.0, -2.2]
    assert terms["loss"][0].tolist() == pytest.approx(want, abs=1e-12)
    assert terms["clipped"][0].tolist() == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert terms["ratio"][0].tolist() == pytest.approx([1.5, 1.25, 0.7, 0.75, 1.5, 1.1], abs=1e-12)
    terms["loss"].sum().backward()
    # d(-A r)/d lp = -A r on the uncut tokens, 0 where a clip decided
    assert lp.grad[0].tolist() == pytest.approx([0.0, -1.25, -0.7, 0.0, 3.0, -2.2], abs=1e-12)
    # Symmetric (clip_eps_high None = clip_eps = 0.2): tokens 0 and 1 both stop at -1.2.
    sym = ppo_policy_terms(lp.detach(), old, adv, 0.2)
    assert sym["loss"][0].tolist() == pytest.approx([-1.2, -1.2, -0.7, 0.8, 3.0, -2.2], abs=1e-12)
    assert sym["clipped"][0].tolist() == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    explicit = ppo_policy_terms(lp.detach(), old, adv, 0.2, clip_eps_high=0.2)
    assert torch.equal(explicit["loss"], sym["loss"])


def test_dual_clip_hand_computed():
    # clip_eps = 0.2, dual_clip c = 3: for A < 0 the loss is at most -c*A.
    #   tok  ratio   A     standard loss          dual-clipped        clipped  grad
    #   0    e^3    -1     20.0855 (-A r)         3 = -c*A             1        0
    #   1    2.0    -1     2.0                    2.0 (< 3: kept)      0        2.0
    #   2    e^3    +1     -1.2 (clip at 1.2)     -1.2 (A > 0: as is)  1        0
    #   3    0.5    +1     -0.5                   -0.5                 0        -0.5
    #   4    0.5    -0.5   0.4 (clip at 0.8)      0.4 (< 1.5)          1        0
    #   5    4.0    -0.5   2.0                    1.5 = -c*A           1        0
    #   6    5.0     0     0                      0 (A = 0: as is)     0        0
    old = torch.full((1, 7), -2.0, dtype=torch.float64)
    log_r = _ratio_logs([1.0, 2.0, 1.0, 0.5, 0.5, 4.0, 5.0])
    log_r[0, 0] = log_r[0, 2] = 3.0
    lp = (old + log_r).requires_grad_(True)
    adv = torch.tensor([[-1.0, -1.0, 1.0, 1.0, -0.5, -0.5, 0.0]], dtype=torch.float64)
    terms = ppo_policy_terms(lp, old, adv, 0.2, dual_clip=3.0)
    loss = terms["loss"][0].detach()
    assert float(loss[0]) == 3.0 and float(loss[5]) == 1.5  # exactly -c*A
    assert loss.tolist() == pytest.approx([3.0, 2.0, -1.2, -0.5, 0.4, 1.5, 0.0], abs=1e-12)
    assert terms["clipped"][0].tolist() == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    terms["loss"].sum().backward()
    assert lp.grad[0].tolist() == pytest.approx([0.0, 2.0, 0.0, -0.5, 0.0, 0.0, 0.0], abs=1e-12)
    # Without the dual clip only tokens 0 and 5 change (the huge ratio now counts in full).
    plain = ppo_policy_terms(lp.detach(), old, adv, 0.2)["loss"][0]
    assert float(plain[0]) == pytest.approx(math.exp(3.0), abs=1e-9)
    assert float(plain[5]) == pytest.approx(2.0, abs=1e-12)
    keep = [1, 2, 3, 4, 6]
    assert torch.equal(plain[keep], loss[keep])


@pytest.mark.parametrize("seed", SEEDS)
def test_dual_clip_leaves_non_negative_advantages_alone(seed):
    lp, old, adv = _policy_inputs(6, 11, seed)
    lp = old + 4.0 * (lp - old)  # ratios up to ~e^2.4, so the dual bound is hit
    with_dual = ppo_policy_terms(lp, old, adv, 0.2, 0.28, dual_clip=2.0)
    without = ppo_policy_terms(lp, old, adv, 0.2, 0.28)
    pos = adv >= 0
    assert torch.equal(with_dual["loss"][pos], without["loss"][pos])
    assert torch.equal(with_dual["clipped"][pos], without["clipped"][pos])
    changed = with_dual["loss"] != without["loss"]
    assert changed.any() and torch.all(adv[changed] < 0)
    # it only ever lowers the loss, to exactly -c*A
    assert torch.all(with_dual["loss"] <= without["loss"])
    torch.testing.assert_close(with_dual["loss"][changed], -2.0 * adv[changed], atol=0, rtol=0)


KNOBS = [(0.2, None, None), (0.2, 0.28, None), (0.2, None, 3.0), (0.1, 0.3, 2.0)]


def _wide_policy_inputs(batch, length, seed):
    """Log-ratios ~ N(0, 0.8^2): ratios spread over every branch (below 1-low, between the
    bounds, above 1+high, above a dual clip c of 2 or 3)."""
    g = torch.Generator().manual_seed(2100 + seed)
    old = -3.0 * torch.rand(batch, length, generator=g, dtype=torch.float64)
    lp = old + 0.8 * torch.randn(batch, length, generator=g, dtype=torch.float64)
    adv = torch.randn(batch, length, generator=g, dtype=torch.float64)
    # ... and a few planted tokens so that every branch is reached whatever the seed:
    # ratio 1.24 / 1.15 with A > 0 (between 1+low and 1+high for both KNOBS with a high
    # bound), ratio 3.5 with A < 0 (above both dual clips).
    for col, ratio, a in [(0, 1.24, 0.7), (1, 1.15, 1.3), (2, 3.5, -0.8)]:
        lp[0, col] = old[0, col] + LN(ratio)
        adv[0, col] = a
    return lp, old, adv


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("clip_eps,high,dual", KNOBS)
def test_ppo_policy_terms_match_reference(seed, clip_eps, high, dual):
    lp, old, adv = _wide_policy_inputs(8, 12, seed)
    lp = lp.requires_grad_(True)
    terms = ppo_policy_terms(lp, old, adv, clip_eps, high, dual)
    exp_loss, exp_cut, exp_grad = ref_ppo_terms(lp.detach(), old, adv, clip_eps, high, dual)
    exp_loss = torch.tensor(exp_loss, dtype=torch.float64)
    torch.testing.assert_close(terms["loss"].detach(), exp_loss, atol=1e-6, rtol=0)
    assert terms["clipped"].tolist() == exp_cut
    log_r = (lp.detach() - old).tolist()
    want_kl = torch.tensor([[0.5 * d * d for d in row] for row in log_r], dtype=torch.float64)
    want_ratio = torch.tensor([[math.exp(d) for d in row] for row in log_r], dtype=torch.float64)
    torch.testing.assert_close(terms["approx_kl"], want_kl, atol=1e-12, rtol=0)
    torch.testing.assert_close(terms["ratio"], want_ratio, atol=1e-12, rtol=1e-12)
    terms["loss"].sum().backward()
    torch.testing.assert_close(
        lp.grad, torch.tensor(exp_grad, dtype=torch.float64), atol=1e-9, rtol=0
    )
    # the random case reaches the branch each knob adds (else the comparison proves little)
    ratio, b_high = want_ratio, 1.0 + (clip_eps if high is None else high)
    if high is not None:
        assert torch.any((adv > 0) & (ratio > 1.0 + clip_eps) & (ratio < b_high))
    if dual is not None:
        assert torch.any((adv < 0) & (-adv * ratio > -dual * adv))


@pytest.mark.parametrize("clip_eps,high,dual", KNOBS)
def test_ppo_policy_terms_float32(clip_eps, high, dual):
    lp, old, adv = _wide_policy_inputs(8, 12, 9)
    terms = ppo_policy_terms(lp.float(), old.float(), adv.float(), clip_eps, high, dual)
    assert terms["loss"].dtype == torch.float32
    exp_loss, _, _ = ref_ppo_terms(lp, old, adv, clip_eps, high, dual)
    torch.testing.assert_close(
        terms["loss"].double(), torch.tensor(exp_loss, dtype=torch.float64), atol=1e-5, rtol=1e-6
    )


# ---------------------------------------------------------------------------------------------
# Loss aggregation: token_mean, seq_mean_token_sum, seq_mean_token_mean
# ---------------------------------------------------------------------------------------------


def ref_aggregate(per_token, mask, mode):
    """Loops over rows and tokens; needs every row non-empty (a row mean of nothing is
    undefined)."""
    x, m = per_token.tolist(), mask.tolist()
    sums = [sum(x[b][t] for t in range(len(x[b])) if m[b][t]) for b in range(len(x))]
    counts = [sum(1 for v in m[b] if v) for b in range(len(x))]
    assert all(counts)
    if mode == "token_mean":
        return sum(sums) / sum(counts)
    if mode == "seq_mean_token_sum":
        return sum(sums) / len(x)
    if mode == "seq_mean_token_mean":
        return sum(s / c for s, c in zip(sums, counts, strict=True)) / len(x)
    raise AssertionError(mode)


def test_loss_aggregations_are_the_three_modes():
    assert set(LOSS_AGGREGATIONS) == {"token_mean", "seq_mean_token_sum", "seq_mean_token_mean"}


@pytest.mark.parametrize(
    "mode,want_loss,want_count,want_weights",
    [
        # tokens 1, 2, 3 | 4: (1 + 2 + 3 + 4) / 4 tokens = 2.5
        ("token_mean", 2.5, 4.0, [[1, 1, 1], [1, 0, 0]]),
        # row sums 6 | 4, averaged over 2 rows: 5
        ("seq_mean_token_sum", 5.0, 2.0, [[1, 1, 1], [1, 0, 0]]),
        # row means 2 | 4, averaged over 2 rows: 3
        ("seq_mean_token_mean", 3.0, 2.0, [[1 / 3, 1 / 3, 1 / 3], [1, 0, 0]]),
    ],
)
def test_aggregation_hand_computed(mode, want_loss, want_count, want_weights):
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), 99.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    assert float(aggregate_loss(per_token, mask, mode)) == pytest.approx(want_loss, abs=1e-6)
    assert float(aggregation_count(mask, mode)) == want_count
    weights = aggregation_weights(mask, mode)
    torch.testing.assert_close(
        weights.double(), torch.tensor(want_weights, dtype=torch.float64), atol=1e-7, rtol=0
    )


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_aggregate_loss_matches_reference(seed, mode, dtype, ragged_mask):
    mask = ragged_mask(7, 10, seed, empty_row=False)
    g = torch.Generator().manual_seed(3100 + seed)
    per_token = 2.0 * torch.randn(7, 10, generator=g, dtype=torch.float64) + 1.0
    loss = aggregate_loss(per_token.to(dtype), mask, mode)
    assert loss.dim() == 0 and loss.dtype == dtype
    atol = 1e-6 if dtype == torch.float64 else 1e-5
    assert float(loss) == pytest.approx(ref_aggregate(per_token, mask, mode), abs=atol)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
def test_aggregate_loss_split_invariance(seed, mode, ragged_mask):
    # The trainer's micro-batch rule: sum over chunks of masked_sum(w*l) (each chunk's
    # all-padding columns trimmed), divided by the WHOLE batch's count, is the whole-batch
    # aggregate. Garbage (NaN included) at padded positions must not matter.
    mask = ragged_mask(9, 10, seed)  # one empty row included
    g = torch.Generator().manual_seed(3300 + seed)
    per_token = torch.randn(9, 10, generator=g, dtype=torch.float64)
    per_token = torch.where(mask, per_token, torch.full_like(per_token, 1e3))
    per_token[~mask & (torch.rand(9, 10, generator=g) < 0.3)] = float("nan")
    whole = aggregate_loss(per_token, mask, mode)
    assert torch.isfinite(whole)
    rng = random.Random(seed)
    for _ in range(4):
        cuts = sorted(rng.sample(range(1, 9), rng.randint(1, 5)))
        bounds = list(zip([0, *cuts], [*cuts, 9], strict=True))
        total, count = 0.0, 0.0
        for lo, hi in bounds:
            m_c = mask[lo:hi]
            width = max(1, int(m_c.sum(1).max()))
            m_c, l_c = m_c[:, :width], per_token[lo:hi, :width]
            w = aggregation_weights(m_c, mode, l_c.dtype)
            total += float(masked_sum(w * l_c, m_c))
            count += float(aggregation_count(m_c, mode))
        assert total / count == pytest.approx(float(whole), abs=1e-9), bounds


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
def test_aggregate_loss_ignores_padding_columns(mode, ragged_mask, pad_columns):
    mask = ragged_mask(6, 8, 4)
    per_token = torch.randn(6, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    (per_token_p,), mask_p = pad_columns([per_token], mask, 4, 5)
    assert float(aggregate_loss(per_token_p, mask_p, mode)) == pytest.approx(
        float(aggregate_loss(per_token, mask, mode)), abs=1e-12
    )


def test_aggregation_modes_weigh_long_answers_differently():
    # One long row of loss 1 and one short row of loss 0: token_mean weighs by tokens
    # (8/9), the sequence modes by rows; token SUMS let the long row weigh 8x (4.0).
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, :] = True
    mask[1, :1] = True
    per_token = torch.zeros(2, 8, dtype=torch.float64)
    per_token[0] = 1.0
    got = {m: float(aggregate_loss(per_token, mask, m)) for m in LOSS_AGGREGATIONS}
    assert got["token_mean"] == pytest.approx(8 / 9, abs=1e-9)
    assert got["seq_mean_token_sum"] == pytest.approx(4.0, abs=1e-9)
    assert got["seq_mean_token_mean"] == pytest.approx(0.5, abs=1e-9)


@pytest.mark.parametrize("mode", ["bogus", "seq-mean-token-mean", "TOKEN_MEAN", ""])
def test_unknown_aggregation_mode_raises(mode):
    mask = torch.tensor([[True, False], [True, True]])
    per_token = torch.ones(2, 2, dtype=torch.float64)
    with pytest.raises(ValueError):
        aggregate_loss(per_token, mask, mode)
    with pytest.raises(ValueError):
        aggregation_weights(mask, mode)


def test_aggregation_count_rejects_an_unknown_mode():
    with pytest.raises(ValueError, match="loss aggregation"):
        aggregation_count(torch.ones(2, 3, dtype=torch.bool), "bogus")
