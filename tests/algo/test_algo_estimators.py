"""Tests for rlhf_dist.algo.estimators (the advantage-estimator registry).

The float64 references below are plain Python loops over rows, tokens and groups written
from the docstrings; they share no code with the module under test (the return-to-go is a
direct double sum, GAE the closed form sum_k (gamma*lam)^k delta_{t+k}, not recursions).
"""

import math
import random

import pytest
import torch

from rlhf_dist.algo import catalog
from rlhf_dist.algo.advantages import gae
from rlhf_dist.algo.estimators import (
    ESTIMATORS,
    AdvantageInputs,
    estimate_advantages,
    group_view,
    grpo_estimator,
    reinforce_pp_baseline_estimator,
    reinforce_pp_estimator,
    rloo_estimator,
)
from rlhf_dist.algo.preference import pair_labels
from rlhf_dist.algo.rewards import shape_rewards

GRPO_EPS = 1e-6  # grpo_estimator's default eps, added to the group std
NAMES = ["gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]
SEEDS = [0, 1, 2]
GROUP_SIZES = [2, 3, 5]
GAMMAS = [1.0, 0.99, 0.5]


# ---------------------------------------------------------------------------------------------
# Inputs: ragged prefix masks with a length-1 row, a full row and (optionally) an empty row
# ---------------------------------------------------------------------------------------------


def _mask_from_lengths(lengths, length):
    mask = torch.zeros(len(lengths), length, dtype=torch.bool)
    for b, n in enumerate(lengths):
        mask[b, :n] = True
    return mask


def _ragged_lengths(batch, length, seed, empty_row=True):
    """Row lengths in [0, length]: one row of length 1, one full, one empty when `empty_row`,
    the rest random (repeats allowed), shuffled so the special rows move around."""
    rng = random.Random(seed)
    lengths = [1, length] + ([0] if empty_row else [])
    assert batch >= len(lengths), "batch too small for the special rows"
    lengths += [rng.randint(1, length) for _ in range(batch - len(lengths))]
    rng.shuffle(lengths)
    return lengths


def _inputs(groups, n, length, seed, gamma=1.0, lam=0.95, empty_row=True, std_normalize=True):
    """Random float64 AdvantageInputs of groups*n rows; rewards/values are 0 off the mask
    (as shape_rewards and the rollout produce them)."""
    batch = groups * n
    mask = _mask_from_lengths(_ragged_lengths(batch, length, seed, empty_row), length)
    g = torch.Generator().manual_seed(4200 + seed)
    scores = 2.0 * torch.randn(batch, generator=g, dtype=torch.float64)
    kl = 0.3 * torch.randn(batch, length, generator=g, dtype=torch.float64)
    rewards = -0.1 * kl
    for b in range(batch):
        n_tok = int(mask[b].sum())
        if n_tok:
            rewards[b, n_tok - 1] += scores[b]
    zero = torch.zeros((), dtype=torch.float64)
    rewards = torch.where(mask, rewards, zero)
    values = torch.where(mask, torch.randn(batch, length, generator=g, dtype=torch.float64), zero)
    return AdvantageInputs(
        rewards=rewards,
        scores=scores,
        response_mask=mask,
        values=values,
        group_size=n,
        gamma=gamma,
        lam=lam,
        std_normalize=std_normalize,
    )


def _with(x: AdvantageInputs, **changes) -> AdvantageInputs:
    fields = dict(
        rewards=x.rewards,
        scores=x.scores,
        response_mask=x.response_mask,
        values=x.values,
        group_size=x.group_size,
        gamma=x.gamma,
        lam=x.lam,
        std_normalize=x.std_normalize,
    )
    fields.update(changes)
    return AdvantageInputs(**fields)


def _close(actual, expected, atol=1e-6):
    torch.testing.assert_close(
        actual.to(torch.float64), torch.as_tensor(expected, dtype=torch.float64), atol=atol, rtol=0
    )


# ---------------------------------------------------------------------------------------------
# float64 references (lists in, nested lists out)
# ---------------------------------------------------------------------------------------------


def _lists(x: AdvantageInputs):
    r = x.rewards.double().tolist()
    m = x.response_mask.bool().tolist()
    lengths = [sum(1 for v in row if v) for row in m]
    return r, m, lengths


def _seq_returns(r, lengths):
    return [sum(r[b][t] for t in range(lengths[b])) for b in range(len(r))]


def _broadcast_rows(per_seq, lengths, width):
    return [
        [per_seq[b] if t < lengths[b] else 0.0 for t in range(width)] for b in range(len(per_seq))
    ]


def ref_return_to_go(r, lengths, gamma):
    """G_t = sum_{s=t}^{L-1} gamma^(s-t) r_s on a prefix mask of length L; 0 beyond."""
    width = len(r[0])
    out = [[0.0] * width for _ in r]
    for b in range(len(r)):
        for t in range(lengths[b]):
            total = 0.0
            for s in range(t, lengths[b]):
                total += gamma ** (s - t) * r[b][s]
            out[b][t] = total
    return out


def ref_gae(x: AdvantageInputs):
    """A_t = sum_{k>=0} (gamma*lam)^k delta_{t+k}, delta_s = r_s + gamma*V_{s+1} - V_s with
    V_L = 0 at the end of the response; returns = A + V; both 0 off the mask."""
    r, _, lengths = _lists(x)
    v = x.values.double().tolist()
    gamma, lam = x.gamma, x.lam
    width = len(r[0])
    adv = [[0.0] * width for _ in r]
    ret = [[0.0] * width for _ in r]
    for b in range(len(r)):
        n = lengths[b]
        delta = [r[b][s] + gamma * (v[b][s + 1] if s + 1 < n else 0.0) - v[b][s] for s in range(n)]
        for t in range(n):
            a = sum((gamma * lam) ** (s - t) * delta[s] for s in range(t, n))
            adv[b][t] = a
            ret[b][t] = a + v[b][t]
    return adv, ret


def ref_grpo(x: AdvantageInputs, eps=GRPO_EPS):
    r, _, lengths = _lists(x)
    R = _seq_returns(r, lengths)
    n = x.group_size
    per_seq = [0.0] * len(R)
    for g in range(len(R) // n):
        group = R[g * n : (g + 1) * n]
        mean = sum(group) / n
        std = math.sqrt(sum((v - mean) ** 2 for v in group) / (n - 1))
        for i in range(n):
            a = group[i] - mean
            per_seq[g * n + i] = a / (std + eps) if x.std_normalize else a
    return _broadcast_rows(per_seq, lengths, len(r[0]))


def ref_rloo(x: AdvantageInputs):
    r, _, lengths = _lists(x)
    R = _seq_returns(r, lengths)
    n = x.group_size
    per_seq = [0.0] * len(R)
    for g in range(len(R) // n):
        for i in range(n):
            others = [R[g * n + j] for j in range(n) if j != i]
            per_seq[g * n + i] = R[g * n + i] - sum(others) / (n - 1)
    return _broadcast_rows(per_seq, lengths, len(r[0]))


def ref_reinforce_pp(x: AdvantageInputs):
    r, _, lengths = _lists(x)
    return ref_return_to_go(r, lengths, x.gamma)


def ref_reinforce_pp_baseline(x: AdvantageInputs):
    r, _, lengths = _lists(x)
    s = x.scores.double().tolist()
    n = x.group_size
    r = [row[:] for row in r]
    for g in range(len(s) // n):
        mean = sum(s[g * n : (g + 1) * n]) / n
        for i in range(n):
            b = g * n + i
            if lengths[b]:
                r[b][lengths[b] - 1] -= mean
    return ref_return_to_go(r, lengths, x.gamma)


def ref_online_dpo(x: AdvantageInputs):
    """+1 on the tokens of each group's first best-scored row, -1 on its first worst-scored
    row's, 0 elsewhere and in groups whose scores all tie."""
    _, _, lengths = _lists(x)
    s, n = x.scores.double().tolist(), x.group_size
    label = [0.0] * len(s)
    for g in range(len(s) // n):
        rows = list(range(g * n, (g + 1) * n))
        hi, lo = max(s[b] for b in rows), min(s[b] for b in rows)
        if hi > lo:
            label[next(b for b in rows if s[b] == hi)] = 1.0
            label[next(b for b in rows if s[b] == lo)] = -1.0
    T = x.rewards.shape[1]
    out = [[label[b] if t < lengths[b] else 0.0 for t in range(T)] for b in range(len(s))]
    return torch.tensor(out, dtype=torch.float64)


def ref_advantages(name, x):
    if name == "gae":
        return ref_gae(x)[0]
    return {
        "grpo": ref_grpo,
        "rloo": ref_rloo,
        "reinforce_pp": ref_reinforce_pp,
        "reinforce_pp_baseline": ref_reinforce_pp_baseline,
    }[name](x)


# ---------------------------------------------------------------------------------------------
# (a) Hand-computed cases
# ---------------------------------------------------------------------------------------------

_NAN = float("nan")


def _hand_group_inputs(std_normalize=True):
    # Two groups of 3. Padding holds NaN / huge values that must be ignored.
    # group 0: R = [0.5+0.5, 2, 1+2+3] = [1, 2, 6] on lengths [2, 1, 3]
    # group 1: R = [4, 4, 4] (identical returns) on lengths [1, 2, 3]
    rewards = torch.tensor(
        [
            [0.5, 0.5, _NAN],
            [2.0, 100.0, -100.0],
            [1.0, 2.0, 3.0],
            [4.0, _NAN, _NAN],
            [1.0, 3.0, 50.0],
            [2.0, 1.0, 1.0],
        ],
        dtype=torch.float64,
    )
    mask = _mask_from_lengths([2, 1, 3, 1, 2, 3], 3)
    scores = torch.tensor([1.0, 2.0, 6.0, 4.0, 4.0, 4.0], dtype=torch.float64)
    return AdvantageInputs(rewards, scores, mask, group_size=3, std_normalize=std_normalize)


def test_grpo_hand_computed():
    # group 0: R = [1, 2, 6], mean 3, R - mean = [-2, -1, 3], squares 4 + 1 + 9 = 14,
    #   unbiased var 14 / 2 = 7, std sqrt(7) = 2.6457513...
    #   A = [-2, -1, 3] / (sqrt(7) + 1e-6) = [-0.7559287, -0.3779643, 1.1338930]
    # group 1: R = [4, 4, 4]: R - mean = 0 and std = 0 -> A = 0 / (0 + eps) = 0 (not NaN)
    adv, ret = grpo_estimator(_hand_group_inputs())
    assert ret is None
    s = math.sqrt(7.0) + 1e-6
    a, b, c = -2.0 / s, -1.0 / s, 3.0 / s
    assert a == pytest.approx(-0.7559287, abs=1e-6) and c == pytest.approx(1.1338930, abs=1e-6)
    want = [[a, a, 0], [b, 0, 0], [c, c, c], [0, 0, 0], [0, 0, 0], [0, 0, 0]]
    _close(adv, want, atol=1e-12)


def test_grpo_without_std_normalisation_hand_computed():
    # Dr. GRPO: A = R - mean only: group 0 -> [-2, -1, 3], group 1 -> [0, 0, 0]
    adv, ret = grpo_estimator(_hand_group_inputs(std_normalize=False))
    assert ret is None
    want = [[-2, -2, 0], [-1, 0, 0], [3, 3, 3], [0, 0, 0], [0, 0, 0], [0, 0, 0]]
    _close(adv, want, atol=1e-12)


def test_rloo_hand_computed():
    # group 0: R = [1, 2, 6]; baseline = mean of the OTHER two:
    #   R=1: (2+6)/2 = 4   -> A = -3
    #   R=2: (1+6)/2 = 3.5 -> A = -1.5
    #   R=6: (1+2)/2 = 1.5 -> A = 4.5        (sum -3 - 1.5 + 4.5 = 0; = 3/2 * [-2, -1, 3])
    # group 1: R = [4, 4, 4] -> A = 0
    adv, ret = rloo_estimator(_hand_group_inputs())
    assert ret is None
    want = [[-3, -3, 0], [-1.5, 0, 0], [4.5, 4.5, 4.5], [0, 0, 0], [0, 0, 0], [0, 0, 0]]
    _close(adv, want, atol=1e-12)


def test_rloo_group_of_two_hand_computed():
    # n = 2: the baseline is the other sample, A = [R1 - R2, R2 - R1] = [-3, 3] for R = [1, 4]
    rewards = torch.tensor([[0.0, 1.0], [4.0, 7.0]], dtype=torch.float64)
    mask = _mask_from_lengths([2, 1], 2)
    x = AdvantageInputs(rewards, torch.zeros(2, dtype=torch.float64), mask, group_size=2)
    adv, _ = rloo_estimator(x)
    _close(adv, [[-3, -3], [3, 0]], atol=1e-12)


def test_online_dpo_labels_hand_computed():
    # groups of 3: scores [0.2, 0.9, -1] -> row 1 chosen, row 2 rejected; [5, 5, 5] tie;
    # a 2-token mask on row 0 and an empty row 2 (its -1 has no token to sit on)
    scores = torch.tensor([0.2, 0.9, -1.0, 5.0, 5.0, 5.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0], [1, 0, 0], [1, 1, 0], [1, 1, 1]]).bool()
    x = AdvantageInputs(torch.zeros(6, 3, dtype=torch.float64), scores, mask, group_size=3)
    labels = pair_labels(x.scores, 3, mask)
    want = [[0, 0, 0], [1, 1, 1], [0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert labels.dtype == torch.float64 and labels.tolist() == want


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("n", [2, 3])
def test_online_dpo_labels_match_the_reference(seed, n):
    # online DPO is an objective of its own (catalog.OBJECTIVES): its labels are preference's
    x = _inputs(4, n, 7, seed)
    labels = pair_labels(x.scores, n, x.response_mask)
    _close(labels, ref_online_dpo(x), atol=0)


def test_reinforce_pp_hand_computed():
    # gamma = 0.5; G_t = r_t + gamma * G_{t+1}, stopping at the last response token.
    #   row 0 (len 3) r = [-0.1, -0.2, 1.0]: G2 = 1.0, G1 = -0.2 + 0.5 = 0.3,
    #                                         G0 = -0.1 + 0.15 = 0.05
    #   row 1 (len 2) r = [0.4, -1.0 | 9]:    G1 = -1.0, G0 = 0.4 - 0.5 = -0.1
    #   row 2 (len 1) r = [2.0 | 9, 9]:       G0 = 2.0
    #   row 3 (empty):                        all 0
    rewards = torch.tensor(
        [[-0.1, -0.2, 1.0], [0.4, -1.0, 9.0], [2.0, 9.0, 9.0], [5.0, 5.0, 5.0]],
        dtype=torch.float64,
    )
    mask = _mask_from_lengths([3, 2, 1, 0], 3)
    x = AdvantageInputs(rewards, torch.zeros(4, dtype=torch.float64), mask, gamma=0.5)
    adv, ret = reinforce_pp_estimator(x)
    assert ret is None
    want = [[0.05, 0.3, 1.0], [-0.1, -1.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    _close(adv, want, atol=1e-12)


def test_reinforce_pp_baseline_hand_computed():
    # gamma = 0.5, groups of 2. The group mean SCORE is subtracted at the last token, then
    # the return-to-go as in REINFORCE++.
    #   group 0: scores [3, 1], mean 2
    #     row 0 (len 3) r = [-0.1, -0.2, 3 - 0.3 = 2.7] -> [-0.1, -0.2, 0.7]
    #       G2 = 0.7, G1 = -0.2 + 0.35 = 0.15, G0 = -0.1 + 0.075 = -0.025
    #     row 1 (len 1) r = [1.0]                     -> [-1.0]: G0 = -1.0
    #   group 1: scores [0.5, 0.5], mean 0.5
    #     row 2 (len 2) r = [0.0, 0.5]                -> [0, 0]: G = [0, 0]
    #     row 3 (len 2) r = [-0.2, 0.5 - 0.1 = 0.4]   -> [-0.2, -0.1]
    #       G1 = -0.1, G0 = -0.2 - 0.05 = -0.25
    rewards = torch.tensor(
        [[-0.1, -0.2, 2.7], [1.0, 7.0, 7.0], [0.0, 0.5, 7.0], [-0.2, 0.4, 7.0]],
        dtype=torch.float64,
    )
    mask = _mask_from_lengths([3, 1, 2, 2], 3)
    scores = torch.tensor([3.0, 1.0, 0.5, 0.5], dtype=torch.float64)
    x = AdvantageInputs(rewards, scores, mask, group_size=2, gamma=0.5)
    adv, ret = reinforce_pp_baseline_estimator(x)
    assert ret is None
    want = [[-0.025, 0.15, 0.7], [-1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [-0.25, -0.1, 0.0]]
    _close(adv, want, atol=1e-12)


def test_gae_estimator_hand_computed():
    # gamma = 0.9, lam = 0.5 (gamma*lam = 0.45)
    #   row 0 (len 2) r = [0, 1], V = [0.5, 0.25]:
    #     t=1: delta = 1 - 0.25 = 0.75                      A1 = 0.75
    #     t=0: delta = 0 + 0.9*0.25 - 0.5 = -0.275          A0 = -0.275 + 0.45*0.75 = 0.0625
    #     returns = A + V = [0.5625, 1.0]
    #   row 1 (len 1) r = [2 | 50], V = [0.5 | 50]: A0 = 2 - 0.5 = 1.5, returns [2.0, 0]
    rewards = torch.tensor([[0.0, 1.0], [2.0, 50.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.25], [0.5, 50.0]], dtype=torch.float64)
    mask = _mask_from_lengths([2, 1], 2)
    x = AdvantageInputs(
        rewards, torch.zeros(2, dtype=torch.float64), mask, values, gamma=0.9, lam=0.5
    )
    adv, ret = estimate_advantages("gae", x)
    _close(adv, [[0.0625, 0.75], [1.5, 0.0]], atol=1e-12)
    _close(ret, [[0.5625, 1.0], [2.0, 0.0]], atol=1e-12)


# ---------------------------------------------------------------------------------------------
# (b) float64 loop references on random ragged masks, and float32
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("n", GROUP_SIZES)
@pytest.mark.parametrize("std_normalize", [True, False])
def test_grpo_matches_reference(seed, n, std_normalize):
    x = _inputs(3, n, 9, seed, std_normalize=std_normalize)
    adv, ret = grpo_estimator(x)
    assert ret is None and adv.shape == x.rewards.shape
    _close(adv, ref_grpo(x))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("n", GROUP_SIZES)
def test_rloo_matches_reference(seed, n):
    x = _inputs(3, n, 9, seed)
    adv, ret = rloo_estimator(x)
    assert ret is None and adv.shape == x.rewards.shape
    _close(adv, ref_rloo(x))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma", GAMMAS)
def test_reinforce_pp_matches_reference(seed, gamma):
    x = _inputs(4, 2, 9, seed, gamma=gamma)
    adv, ret = reinforce_pp_estimator(x)
    assert ret is None and adv.shape == x.rewards.shape
    _close(adv, ref_reinforce_pp(x))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("n", GROUP_SIZES)
@pytest.mark.parametrize("gamma", GAMMAS)
def test_reinforce_pp_baseline_matches_reference(seed, n, gamma):
    x = _inputs(3, n, 9, seed, gamma=gamma)
    adv, ret = reinforce_pp_baseline_estimator(x)
    assert ret is None and adv.shape == x.rewards.shape
    _close(adv, ref_reinforce_pp_baseline(x))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 0.95), (0.5, 0.0), (1.0, 1.0)])
def test_gae_estimator_matches_reference(seed, gamma, lam):
    x = _inputs(4, 2, 9, seed, gamma=gamma, lam=lam)
    adv, ret = ESTIMATORS["gae"].fn(x)
    exp_adv, exp_ret = ref_gae(x)
    _close(adv, exp_adv)
    _close(ret, exp_ret)


def _to_float32(x: AdvantageInputs) -> AdvantageInputs:
    return _with(x, rewards=x.rewards.float(), scores=x.scores.float(), values=x.values.float())


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n", [2, 4])
def test_estimators_float32(name, n):
    # Scores ~ N(0, 4), returns summed over up to 9 tokens: a float32 error of ~1e-5 at most.
    x = _inputs(3, n, 9, 11 + n, gamma=0.99)
    adv, ret = estimate_advantages(name, _to_float32(x))
    assert adv.dtype == torch.float32
    _close(adv, ref_advantages(name, x), atol=2e-5)
    if name == "gae":
        assert ret.dtype == torch.float32
        _close(ret, ref_gae(x)[1], atol=2e-5)


# ---------------------------------------------------------------------------------------------
# (c) Properties
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("seed", SEEDS)
def test_zero_outside_mask_and_nan_padding_does_not_leak(name, seed):
    x = _inputs(3, 3, 9, seed, gamma=0.9)
    mask = x.response_mask
    adv, ret = estimate_advantages(name, x)
    nan = torch.full_like(x.rewards, float("nan"))
    x_nan = _with(
        x, rewards=torch.where(mask, x.rewards, nan), values=torch.where(mask, x.values, nan)
    )
    adv_nan, ret_nan = estimate_advantages(name, x_nan)
    assert torch.isfinite(adv_nan).all()
    torch.testing.assert_close(adv_nan, adv, atol=0, rtol=0)
    for out in (adv, adv_nan):
        assert torch.all(out[~mask] == 0)
    assert adv[mask].abs().sum() > 0  # the estimator produced something on the real tokens
    if ret is not None:
        assert torch.isfinite(ret_nan).all()
        torch.testing.assert_close(ret_nan, ret, atol=0, rtol=0)
        assert torch.all(ret[~mask] == 0) and torch.all(ret_nan[~mask] == 0)


def _per_sequence(adv, x):
    """The one advantage of each (non-empty) sequence: its value at token 0, checked to be
    the same on every response token."""
    per_seq = adv[:, 0]
    assert torch.all(x.response_mask[:, 0]), "needs every row non-empty"
    for b in range(adv.shape[0]):
        row = adv[b][x.response_mask[b]]
        assert torch.all(row == per_seq[b])
    return per_seq


def _returns_by_group(x):
    r, _, lengths = _lists(x)
    R = _seq_returns(r, lengths)
    n = x.group_size
    return [R[g * n : (g + 1) * n] for g in range(len(R) // n)]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("n", GROUP_SIZES)
@pytest.mark.parametrize("std_normalize", [True, False])
def test_grpo_sums_to_zero_in_each_group(seed, n, std_normalize):
    x = _inputs(4, n, 8, seed, empty_row=False, std_normalize=std_normalize)
    per_seq = _per_sequence(grpo_estimator(x)[0], x)
    sums = group_view(per_seq, n).sum(dim=1)
    torch.testing.assert_close(sums, torch.zeros_like(sums), atol=1e-12, rtol=0)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("n", GROUP_SIZES)
def test_grpo_normalised_groups_have_unit_std(seed, n):
    # A_i = (R_i - mean)/(std + eps): within a group the unbiased std of A is
    # std/(std + eps), i.e. 1 up to eps.
    x = _inputs(4, n, 8, seed, empty_row=False)
    stds = group_view(_per_sequence(grpo_estimator(x)[0], x), n).std(dim=1).tolist()
    for g, group in enumerate(_returns_by_group(x)):
        mean = sum(group) / n
        s = math.sqrt(sum((v - mean) ** 2 for v in group) / (n - 1))
        assert stds[g] == pytest.approx(s / (s + GRPO_EPS), abs=1e-9)
        assert stds[g] == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("n", GROUP_SIZES)
def test_grpo_without_std_is_return_minus_group_mean(seed, n):
    x = _inputs(4, n, 8, seed, empty_row=False, std_normalize=False)
    per_seq = _per_sequence(grpo_estimator(x)[0], x).tolist()
    for g, group in enumerate(_returns_by_group(x)):
        mean = sum(group) / n
        for i in range(n):
            assert per_seq[g * n + i] == pytest.approx(group[i] - mean, abs=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("n", GROUP_SIZES)
def test_rloo_sums_to_zero_and_is_scaled_centred_return(seed, n):
    # sum_i (R_i - (S - R_i)/(n-1)) = S - (nS - S)/(n-1) = 0, and
    # R_i - (S - R_i)/(n-1) = n/(n-1) * (R_i - S/n).
    x = _inputs(4, n, 8, seed, empty_row=False)
    per_seq = _per_sequence(rloo_estimator(x)[0], x)
    sums = group_view(per_seq, n).sum(dim=1)
    torch.testing.assert_close(sums, torch.zeros_like(sums), atol=1e-12, rtol=0)
    values = per_seq.tolist()
    for g, group in enumerate(_returns_by_group(x)):
        mean = sum(group) / n
        for i in range(n):
            assert values[g * n + i] == pytest.approx(n / (n - 1) * (group[i] - mean), abs=1e-12)


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_pp_baseline"])
def test_group_estimators_ignore_a_per_group_score_offset(name):
    # Adding a constant c_g to the score of every sample of group g (at its last token, and
    # to `scores`) moves nothing: every group estimator compares samples of one prompt.
    x = _inputs(4, 3, 8, 5, gamma=0.9, empty_row=False)
    offsets = torch.tensor([10.0, -3.0, 0.5, 7.0], dtype=torch.float64).repeat_interleave(3)
    lengths = x.response_mask.sum(1)
    bump = torch.zeros_like(x.rewards)
    bump[torch.arange(12), lengths - 1] = offsets
    shifted = _with(x, rewards=x.rewards + bump, scores=x.scores + offsets)
    adv, _ = estimate_advantages(name, x)
    adv_shifted, _ = estimate_advantages(name, shifted)
    torch.testing.assert_close(adv_shifted, adv, atol=1e-9, rtol=0)
    # ... while a per-SAMPLE offset does move them (the check above can fail).
    sample_bump = torch.zeros_like(x.rewards)
    sample_bump[torch.arange(12), lengths - 1] = torch.arange(12, dtype=torch.float64)
    moved = _with(x, rewards=x.rewards + sample_bump, scores=x.scores + torch.arange(12.0))
    assert not torch.allclose(estimate_advantages(name, moved)[0], adv, atol=1e-3)


def test_groups_are_contiguous_rows():
    # Rows [g*n, (g+1)*n) are one prompt's samples: with returns [0, 0, 6, 6] and n = 2 the
    # two groups are constant (advantage 0); grouped as n = 4 they are not.
    rewards = torch.tensor([[0.0], [0.0], [6.0], [6.0]], dtype=torch.float64)
    mask = torch.ones(4, 1, dtype=torch.bool)
    x = AdvantageInputs(rewards, rewards[:, 0].clone(), mask, group_size=2)
    for name in ("grpo", "rloo", "reinforce_pp_baseline"):
        adv, _ = estimate_advantages(name, x)
        assert torch.all(adv == 0), name
        adv4, _ = estimate_advantages(name, _with(x, group_size=4))
        assert torch.all(adv4 != 0), name


def test_registry_flags():
    assert set(ESTIMATORS) == set(NAMES)
    flags = {k: tuple(e.traits) for k, e in ESTIMATORS.items()}
    assert flags == {
        "gae": (True, False, True),
        "grpo": (False, True, False),
        "rloo": (False, True, False),
        "reinforce_pp": (False, False, True),
        "reinforce_pp_baseline": (False, True, True),
    }
    assert set(catalog.OBJECTIVES) == {"distill", "online_dpo"}  # objectives, not estimators
    assert catalog.ESTIMATORS == {**catalog.ADVANTAGE_ESTIMATORS, **catalog.OBJECTIVES}


@pytest.mark.parametrize("name", NAMES)
def test_estimate_advantages_dispatches_by_name(name):
    x = _inputs(3, 3, 8, 7, gamma=0.9, lam=0.8)
    adv, ret = estimate_advantages(name, x)
    _close(adv, ref_advantages(name, x))
    direct_adv, direct_ret = ESTIMATORS[name].fn(x)
    assert torch.equal(adv, direct_adv)
    # ... and it is this estimator, not another one: every other one gives something else
    for other in NAMES:
        if other != name:
            assert not torch.allclose(adv, estimate_advantages(other, x)[0], atol=1e-3), other
    if ESTIMATORS[name].traits.needs_critic:
        assert ret is not None and torch.equal(ret, direct_ret)
        _close(ret, ref_gae(x)[1])
    else:
        assert ret is None and direct_ret is None


def test_unknown_estimator_name_raises():
    x = _inputs(2, 2, 4, 0)
    with pytest.raises((KeyError, ValueError)):
        estimate_advantages("ppo", x)


@pytest.mark.parametrize("seed", SEEDS)
def test_gae_returns_are_advantages_plus_values(seed):
    x = _inputs(3, 2, 9, seed, gamma=0.99, lam=0.95)
    adv, ret = estimate_advantages("gae", x)
    mask = x.response_mask
    torch.testing.assert_close(ret[mask], (adv + x.values)[mask], atol=1e-12, rtol=0)
    assert torch.all(ret[~mask] == 0)


def test_group_view_raises_when_rows_do_not_split():
    group_view(torch.arange(6.0), 3)  # fine
    assert group_view(torch.arange(6.0), 3).tolist() == [[0, 1, 2], [3, 4, 5]]
    for b, n in [(5, 2), (7, 3), (4, 0)]:
        with pytest.raises(ValueError):
            group_view(torch.arange(float(b)), n)


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_pp_baseline"])
def test_group_estimators_raise_on_a_partial_group(name):
    x = _inputs(2, 3, 6, 1)  # 6 rows
    with pytest.raises(ValueError):
        estimate_advantages(name, _with(x, group_size=4))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma", GAMMAS)
def test_reinforce_pp_is_gae_with_zero_values_and_lambda_one(seed, gamma):
    # Whatever critic values and lam the inputs carry, REINFORCE++ ignores them.
    x = _inputs(4, 2, 9, seed, gamma=gamma, lam=0.3)
    adv, _ = estimate_advantages("reinforce_pp", x)
    gae_adv, gae_ret = gae(x.rewards, torch.zeros_like(x.rewards), x.response_mask, gamma, 1.0)
    torch.testing.assert_close(adv, gae_adv, atol=1e-12, rtol=0)
    torch.testing.assert_close(adv, gae_ret, atol=1e-12, rtol=0)  # V = 0: returns == A
    via_registry, _ = estimate_advantages("gae", _with(x, values=torch.zeros_like(x.values), lam=1))
    torch.testing.assert_close(adv, via_registry, atol=1e-12, rtol=0)


@pytest.mark.parametrize("seed", SEEDS)
def test_gamma_one_return_to_go_sums_later_kl_penalties(seed):
    # Real shaped rewards: r_t = -beta*KL_t (+ score at the last token). With gamma = 1,
    # G_t = score - beta * sum_{s >= t} KL_s: every later token's KL penalty counts in full;
    # the baseline variant subtracts the group-mean score on top.
    mask = _mask_from_lengths(_ragged_lengths(6, 8, seed), 8)
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(6, 8, generator=g, dtype=torch.float64) * 3
    ref_logprobs = logprobs + 0.4 * torch.randn(6, 8, generator=g, dtype=torch.float64)
    scores = torch.randn(6, generator=g, dtype=torch.float64)
    beta = 0.2
    rewards, kl = shape_rewards(scores, logprobs, ref_logprobs, mask, beta)
    x = AdvantageInputs(rewards, scores, mask, group_size=3, gamma=1.0)
    adv, _ = estimate_advantages("reinforce_pp", x)
    adv_b, _ = estimate_advantages("reinforce_pp_baseline", x)
    group_mean = scores.reshape(2, 3).mean(1).repeat_interleave(3).tolist()
    assert kl[mask].abs().sum() > 0
    for b in range(6):
        n = int(mask[b].sum())
        for t in range(n):
            later_kl = sum(float(kl[b, s]) for s in range(t, n))
            want = float(scores[b]) - beta * later_kl
            assert float(adv[b, t]) == pytest.approx(want, abs=1e-12)
            assert float(adv_b[b, t]) == pytest.approx(want - group_mean[b], abs=1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_estimators_do_not_modify_inputs(name):
    x = _inputs(3, 3, 8, 2, gamma=0.9)
    tensors = (x.rewards, x.scores, x.response_mask, x.values)
    originals = [t.clone() for t in tensors]
    estimate_advantages(name, x)
    for now, before in zip(tensors, originals, strict=True):
        assert torch.equal(now, before)


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_leave_one_out_and_std_baselines_refuse_groups_of_one(name):
    # One sample has no other samples to compare with: an error, not NaN advantages.
    mask = torch.ones(3, 2, dtype=torch.bool)
    inputs = AdvantageInputs(torch.ones(3, 2), torch.ones(3), mask, group_size=1)
    with pytest.raises(ValueError, match="at least 2"):
        ESTIMATORS[name].fn(inputs)
