"""Masks with gaps (multi-turn episodes: tool tokens are not the policy's, docs/agents.md):
masking.pack_masked / unpack_masked and estimators.estimate_on_masked_tokens.

References are plain Python per-row loops over the masked entries, sharing no code with
the functions under test.
"""

import random

import pytest
import torch

from rlhf_dist.algo.estimators import (
    ESTIMATORS,
    AdvantageInputs,
    estimate_advantages,
    estimate_on_masked_tokens,
)
from rlhf_dist.algo.masking import pack_masked, unpack_masked

T_, F_ = True, False


def test_pack_and_unpack_by_hand():
    x = torch.tensor([[1.0, 2, 3, 4, 5], [6, 7, 8, 9, 10], [1, 1, 1, 1, 1]])
    mask = torch.tensor([[T_, F_, F_, T_, T_], [F_, T_, F_, T_, F_], [F_] * 5])
    before = x.clone()
    packed, packed_mask = pack_masked(x, mask)
    assert packed.tolist() == [[1, 4, 5, 0, 0], [7, 9, 0, 0, 0], [0] * 5]
    assert packed_mask.tolist() == [[T_, T_, T_, F_, F_], [T_, T_, F_, F_, F_], [F_] * 5]
    assert unpack_masked(packed, mask).tolist() == [[1, 0, 0, 4, 5], [0, 7, 0, 9, 0], [0] * 5]
    assert torch.equal(x, before)


def test_gae_bootstraps_across_a_gap_by_hand():
    """Turn 1 (t=0), tool tokens (t=1,2), turn 2 (t=3,4), score 1 at the end; gamma =
    lam = 1. Packed: r = [0, 0, 1], V = [0.5, 0.2, 0.4] -> A = [0.5, 0.8, 0.6] (delta_0 =
    0 + 0.2 - 0.5, delta_1 = 0 + 0.4 - 0.2, delta_2 = 1 - 0.4), returns = A + V = 1."""
    mask = torch.tensor([[T_, F_, F_, T_, T_]])
    inputs = AdvantageInputs(
        rewards=torch.tensor([[0.0, 7.0, 7.0, 0.0, 1.0]]),  # garbage on the tool tokens
        scores=torch.tensor([1.0]),
        response_mask=mask,
        values=torch.tensor([[0.5, 9.0, 9.0, 0.2, 0.4]]),
        gamma=1.0,
        lam=1.0,
    )
    advantages, returns = estimate_on_masked_tokens("gae", inputs)
    assert torch.allclose(advantages, torch.tensor([[0.5, 0, 0, 0.8, 0.6]]))
    assert torch.allclose(returns, torch.tensor([[1.0, 0, 0, 1.0, 1.0]]))
    # Without packing the first turn's return stops at the gap: it never sees the score.
    plain, _ = estimate_advantages("gae", inputs)
    assert torch.allclose(plain[0, 0], torch.tensor(0.0 - 0.5))


def _gappy_mask(B, T, rng):
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        mask[b] = torch.tensor([rng.random() < 0.6 for _ in range(T)])
        mask[b, rng.randrange(T)] = True
    return mask


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_estimates_equal_those_of_the_rows_compacted_by_hand(name, seed):
    rng, n, B, T = random.Random(seed), 2, 6, 9
    g = torch.Generator().manual_seed(seed)
    mask = _gappy_mask(B, T, rng)
    rewards, values = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    scores = torch.randn(B, generator=g)
    inputs = AdvantageInputs(rewards, scores, mask, values, n, gamma=0.9, lam=0.8)
    advantages, returns = estimate_on_masked_tokens(name, inputs)
    # Reference: each row's masked entries copied to the front by a Python loop.
    rows = [[t for t in range(T) if mask[b, t]] for b in range(B)]
    compact_mask = torch.zeros(B, T, dtype=torch.bool)
    compact_r, compact_v = torch.zeros(B, T), torch.zeros(B, T)
    for b, ts in enumerate(rows):
        for k, t in enumerate(ts):
            compact_mask[b, k], compact_r[b, k], compact_v[b, k] = True, rewards[b, t], values[b, t]
    ref_inputs = AdvantageInputs(compact_r, scores, compact_mask, compact_v, n, 0.9, 0.8)
    ref_a, ref_ret = estimate_advantages(name, ref_inputs)
    for b, ts in enumerate(rows):
        for k, t in enumerate(ts):
            assert torch.isclose(advantages[b, t], ref_a[b, k], atol=1e-6)
            if returns is not None:
                assert torch.isclose(returns[b, t], ref_ret[b, k], atol=1e-6)
    assert (advantages[~mask] == 0).all()


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_a_prefix_mask_gives_the_plain_estimate(name):
    g = torch.Generator().manual_seed(3)
    lengths = [3, 7, 1, 5]
    mask = torch.arange(7)[None, :] < torch.tensor(lengths)[:, None]
    inputs = AdvantageInputs(
        torch.randn(4, 7, generator=g), torch.randn(4, generator=g), mask,
        torch.randn(4, 7, generator=g), 2, 0.95, 0.9,
    )  # fmt: skip
    a, r = estimate_on_masked_tokens(name, inputs)
    ref_a, ref_r = estimate_advantages(name, inputs)
    assert torch.equal(a, torch.where(mask, ref_a, 0.0))
    if r is not None:
        assert torch.equal(r, torch.where(mask, ref_r, 0.0))
