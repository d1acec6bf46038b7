"""Tests for rlhf_dist.algo.rollout_correction (ppo.rollout_correction: tis, mis, icepop at
token or sequence level): a hand-computed case and properties per function."""

import math

import pytest
import torch

from rlhf_dist.algo.rollout_correction import (
    masked_weights,
    rollout_correction_weights,
    rollout_log_ratio,
    truncated_weights,
)

LN = math.log
# Two rows; row 0 has 3 response tokens, row 1 has 2 (its last column is padding).
OLD = torch.tensor([[LN(0.5), LN(0.2), LN(0.9)], [LN(0.3), LN(0.6), LN(0.7)]])
ROLLOUT = torch.tensor([[LN(0.25), LN(0.4), LN(0.3)], [LN(0.4), LN(0.5), LN(0.1)]])
MASK = torch.tensor([[True, True, True], [True, True, False]])
# token ratios pi_old / pi_rollout: row 0: 2, 0.5, 3; row 1: 0.75, 1.2, (7: padding)
# sequence ratios: row 0: 2 * 0.5 * 3 = 3; row 1: 0.75 * 1.2 = 0.9


def _random(seed: int, shape=(4, 7)):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(*shape, generator=g) * 4
    rollout = -torch.rand(*shape, generator=g) * 4
    lengths = torch.randint(0, shape[1] + 1, (shape[0],), generator=g)
    mask = torch.arange(shape[1])[None, :] < lengths[:, None]
    return old, rollout, mask


def test_rollout_log_ratio_hand_computed():
    token = rollout_log_ratio(OLD, ROLLOUT, MASK, "token")
    want = torch.tensor([[LN(2), LN(0.5), LN(3)], [LN(0.75), LN(1.2), 0.0]])
    torch.testing.assert_close(token, want)
    sequence = rollout_log_ratio(OLD, ROLLOUT, MASK, "sequence")
    torch.testing.assert_close(sequence, torch.tensor([[LN(3)] * 3, [LN(0.9), LN(0.9), 0.0]]))


@pytest.mark.parametrize("seed", range(4))
def test_rollout_log_ratio_properties(seed):
    old, rollout, mask = _random(seed)
    old.requires_grad_(True)
    token = rollout_log_ratio(old, rollout, mask, "token")
    sequence = rollout_log_ratio(old, rollout, mask, "sequence")
    assert not token.requires_grad and not sequence.requires_grad
    assert (token[~mask] == 0).all() and (sequence[~mask] == 0).all()
    # the sequence log-ratio is the sum of the token ones, on every token of the row
    for b in range(mask.shape[0]):
        if mask[b].any():
            total = token[b].sum()
            torch.testing.assert_close(sequence[b][mask[b]], total.expand(int(mask[b].sum())))
    same = rollout_log_ratio(rollout, rollout, mask, "sequence")
    assert (same == 0).all()  # same sampler: nothing to correct
    with pytest.raises(ValueError, match="level"):
        rollout_log_ratio(old, rollout, mask, "row")


def test_truncated_weights_hand_computed():
    w, capped = truncated_weights(torch.tensor([LN(2), LN(0.5), LN(3), 1e4]), high=2.5)
    torch.testing.assert_close(w, torch.tensor([2.0, 0.5, 2.5, 2.5]))  # 1e4: overflow -> cap
    assert capped.tolist() == [False, False, True, True]


@pytest.mark.parametrize("seed", range(4))
def test_truncated_weights_properties(seed):
    log_ratio = torch.randn(5, 6, generator=torch.Generator().manual_seed(seed)) * 2
    w, capped = truncated_weights(log_ratio, high=1.5)
    ratio = log_ratio.exp()
    assert (w <= 1.5).all() and (w > 0).all()
    torch.testing.assert_close(w[~capped], ratio[~capped])  # untouched under the cap
    assert (w[capped] == 1.5).all() and (ratio[capped] > 1.5).all()


def test_masked_weights_hand_computed():
    log_ratio = torch.tensor([LN(2), LN(0.5), LN(3), LN(0.2)])
    w, outside = masked_weights(log_ratio, low=0.4, high=2.5)
    torch.testing.assert_close(w, torch.tensor([2.0, 0.5, 0.0, 0.0]))
    assert outside.tolist() == [False, False, True, True]
    w, outside = masked_weights(log_ratio, low=0.0, high=2.5)  # mis: the upper tail only
    torch.testing.assert_close(w, torch.tensor([2.0, 0.5, 0.0, 0.2]))


@pytest.mark.parametrize("seed", range(4))
def test_masked_weights_properties(seed):
    log_ratio = torch.randn(5, 6, generator=torch.Generator().manual_seed(seed))
    w, outside = masked_weights(log_ratio, low=0.6, high=1.4)
    ratio = log_ratio.exp()
    assert (w[outside] == 0).all()
    torch.testing.assert_close(w[~outside], ratio[~outside])  # kept tokens: the plain ratio
    assert ((ratio[~outside] >= 0.6) & (ratio[~outside] <= 1.4)).all()
    wide, wide_out = masked_weights(log_ratio, low=0.0, high=float("inf"))
    assert not wide_out.any()  # no bound: plain importance sampling
    torch.testing.assert_close(wide, ratio)


def test_rollout_correction_weights_hand_computed():
    w, c = rollout_correction_weights(OLD, ROLLOUT, MASK, "tis", "token", 0.5, 2.5)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 2.5], [0.75, 1.2, 1.0]]))
    assert c.tolist() == [[False, False, True], [False, False, False]]
    w, c = rollout_correction_weights(OLD, ROLLOUT, MASK, "tis", "sequence", 0.5, 2.5)
    torch.testing.assert_close(w, torch.tensor([[2.5, 2.5, 2.5], [0.9, 0.9, 1.0]]))
    assert c.tolist() == [[True, True, True], [False, False, False]]
    w, c = rollout_correction_weights(OLD, ROLLOUT, MASK, "mis", "sequence", 0.5, 2.5)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0, 0.0], [0.9, 0.9, 1.0]]))
    w, c = rollout_correction_weights(OLD, ROLLOUT, MASK, "icepop", "token", 0.8, 2.5)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.2, 1.0]]))
    assert c.tolist() == [[False, True, True], [True, False, False]]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    "method,level",
    [
        ("tis", "token"),
        ("tis", "sequence"),
        ("mis", "token"),
        ("mis", "sequence"),
        ("icepop", "token"),
    ],
)
def test_rollout_correction_weights_properties(seed, method, level):
    old, rollout, mask = _random(seed)
    old.requires_grad_(True)
    w, corrected = rollout_correction_weights(old, rollout, mask, method, level, 0.7, 1.6)
    assert not w.requires_grad
    assert (w[~mask] == 1).all() and not corrected[~mask].any()
    assert (w >= 0).all() and (w <= 1.6).all()
    ratio = rollout_log_ratio(old, rollout, mask, level).exp()
    kept = mask & ~corrected
    torch.testing.assert_close(w[kept], ratio[kept])  # uncorrected tokens: the plain ratio
    if method != "tis":
        assert (w[corrected] == 0).all()  # masked, not capped
    # the same sampler as the trainer: every weight 1, nothing corrected
    w, corrected = rollout_correction_weights(rollout, rollout, mask, method, level, 0.7, 1.6)
    assert (w == 1).all() and not corrected.any()


def test_rollout_correction_weights_rejects_bad_names():
    with pytest.raises(ValueError, match="icepop"):
        rollout_correction_weights(OLD, ROLLOUT, MASK, "icepop", "sequence", 0.5, 2.0)
    with pytest.raises(ValueError, match="rollout correction"):
        rollout_correction_weights(OLD, ROLLOUT, MASK, "none", "token", 0.5, 2.0)
