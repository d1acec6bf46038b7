"""Unit tests of rlhf_dist.trainers.reward.expected_calibration_error.

The input is P(chosen preferred) for pairs whose label is always "chosen wins": each pair
is folded to its predicted winner (confidence max(p, 1-p), correct iff p > 0.5), then
ECE = sum over bins of |accuracy - confidence| * share of pairs in the bin.
"""

import pytest
import torch

from rlhf_dist.trainers.reward import expected_calibration_error


def synthetic(confidence: torch.Tensor, true_accuracy: torch.Tensor, seed: int) -> torch.Tensor:
    """prob_chosen for pairs predicted with `confidence`, right with prob `true_accuracy`."""
    g = torch.Generator().manual_seed(seed)
    right = torch.rand(confidence.shape, generator=g) < true_accuracy
    # Right: the model favoured chosen (p = c > 0.5); wrong: it favoured rejected.
    return torch.where(right, confidence, 1 - confidence)


def test_two_bins_by_hand():
    p = torch.tensor([0.6, 0.4, 0.9, 0.8])
    # confidence [0.6, 0.6, 0.9, 0.8], correct [1, 0, 1, 1]
    # bin [0.5, 0.75): acc 0.5, conf 0.6  -> |0.5-0.6| * 2/4 = 0.05
    # bin [0.75, 1]:   acc 1.0, conf 0.85 -> |1-0.85| * 2/4 = 0.075
    assert expected_calibration_error(p, n_bins=2) == pytest.approx(0.125, abs=1e-6)


def test_one_bin_is_the_gap_between_mean_accuracy_and_mean_confidence():
    p = torch.tensor([0.7, 0.2, 0.95, 0.55, 0.45])
    confidence = torch.maximum(p, 1 - p)
    accuracy = (p > 0.5).float().mean()
    expected = float((accuracy - confidence.mean()).abs())
    assert expected_calibration_error(p, n_bins=1) == pytest.approx(expected, abs=1e-6)


def test_perfectly_calibrated_is_near_zero():
    n = 200_000
    g = torch.Generator().manual_seed(1)
    confidence = 0.5 + 0.5 * torch.rand(n, generator=g, dtype=torch.float64)
    p = synthetic(confidence, confidence, seed=2)
    # Sampling noise per bin is ~sqrt(0.25/20000) = 0.0035, the within-bin spread of
    # confidence cancels because accuracy tracks it linearly.
    assert expected_calibration_error(p) < 0.01


def test_overconfident_is_large():
    n = 50_000
    g = torch.Generator().manual_seed(3)
    confidence = 0.9 + 0.1 * torch.rand(n, generator=g, dtype=torch.float64)
    p = synthetic(confidence, torch.full((n,), 0.6, dtype=torch.float64), seed=4)
    # Mean confidence 0.95 against 60 % accuracy: ECE ~ 0.35.
    assert expected_calibration_error(p) == pytest.approx(0.35, abs=0.02)


def test_underconfident_is_large_too():
    # Always right, but only 55-60 % sure: the gap is ~0.425 whatever its sign.
    n = 10_000
    g = torch.Generator().manual_seed(5)
    confidence = 0.55 + 0.05 * torch.rand(n, generator=g, dtype=torch.float64)
    assert expected_calibration_error(confidence) == pytest.approx(0.425, abs=0.01)


def test_symmetric_in_which_side_is_favoured():
    # Folding: predicting rejected with 0.8 is as confident as predicting chosen with 0.8.
    assert expected_calibration_error(torch.tensor([0.2, 0.2])) == pytest.approx(0.8)
    assert expected_calibration_error(torch.tensor([0.8, 0.8])) == pytest.approx(0.2)
