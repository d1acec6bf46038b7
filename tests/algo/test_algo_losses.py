"""Tests for rlhf_dist.algo.losses (ppo_policy_loss, value_loss, pairwise_reward_loss)."""

import math

import pytest
import torch

from rlhf_dist.algo.losses import (
    pairwise_reward_loss,
    pairwise_reward_terms,
    ppo_policy_loss,
    value_loss,
)

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
