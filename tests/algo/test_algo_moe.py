"""Tests for rlhf_dist.algo.moe: the load-balancing loss (Switch Transformer eq. 4-6) and
its global-batch split (fractions counted over the whole batch, shares added)."""

import math

import pytest
import torch

from rlhf_dist.algo.moe import (
    expert_counts,
    load_balancing_loss,
    load_balancing_sum,
    router_prob_sums,
)

LN3 = math.log(3.0)


def test_moe_hand_case_one_layer_top1():
    # probs (.75, .25), (.75, .25), (.25, .75): f = (2/3, 1/3), P = (1.75/3, 1.25/3)
    # loss = 2 * (2/3 * 1.75/3 + 1/3 * 1.25/3) = 9.5 / 9
    logits = torch.tensor([[LN3, 0.0], [LN3, 0.0], [0.0, LN3]])
    assert expert_counts(logits, 1).tolist() == [2.0, 1.0]
    assert torch.allclose(router_prob_sums(logits), torch.tensor([1.75, 1.25]))
    assert load_balancing_loss([logits], 1).item() == pytest.approx(9.5 / 9, abs=1e-6)


def test_moe_hand_case_mask_and_layers():
    # a 4th padded token that would change both f and P is left out; a second layer with
    # uniform probabilities (top-2 counts every real token for both experts)
    logits = torch.tensor([[LN3, 0.0], [LN3, 0.0], [0.0, LN3], [0.0, 9.0]])
    mask = torch.tensor([1, 1, 1, 0])
    uniform = torch.zeros(4, 2)
    assert expert_counts(uniform, 2, mask).tolist() == [3.0, 3.0]
    loss = load_balancing_loss([logits, uniform], 1, mask)
    # layer 2 at top-1: ties go to one expert for all 3 real tokens: f = (1, 0) or (0, 1),
    # P = (.5, .5): 2 * 1 * .5 = 1; mean over layers (9.5/9 + 1) / 2
    assert loss.item() == pytest.approx((9.5 / 9 + 1.0) / 2, abs=1e-6)


def test_moe_balanced_routing_gives_top_k():
    # every expert equally likely and equally chosen: E * sum_i (k/E) (1/E) = k
    logits = torch.zeros(8, 4)
    logits[torch.arange(8), torch.arange(8) % 4] = 1e-3  # breaks ties evenly, P ~ 1/4
    assert load_balancing_loss([logits], 1).item() == pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_moe_split_invariance(seed):
    """Property: cutting the tokens into micro-batches, each adding its share
    load_balancing_sum(own prob sums, GLOBAL fractions) / N, gives the whole batch's loss
    and the same gradient for any cut."""
    g = torch.Generator().manual_seed(seed)
    layers, n, experts, k = 3, 23, 5, 2
    logits = torch.randn(layers, n, experts, generator=g, dtype=torch.float64)
    mask = (torch.rand(n, generator=g) > 0.2).long()
    whole = logits.clone().requires_grad_(True)
    ref = load_balancing_loss(list(whole), k, mask)
    ref.backward()
    cuts = sorted(torch.randperm(n - 1, generator=g)[:3].add(1).tolist())
    parts = list(zip([0, *cuts], [*cuts, n], strict=True))
    split = logits.clone().requires_grad_(True)
    counts = sum(
        torch.stack([expert_counts(split[l_, a:b], k, mask[a:b]) for l_ in range(layers)])
        for a, b in parts
    )
    total = mask.sum()
    loss = torch.zeros((), dtype=torch.float64)
    for a, b in parts:  # each micro-batch's share, backward separately as a trainer would
        sums = torch.stack([router_prob_sums(split[l_, a:b], mask[a:b]) for l_ in range(layers)])
        share = load_balancing_sum(sums, counts / total) / total
        share.backward()
        loss = loss + share.detach()
    assert loss.item() == pytest.approx(ref.item(), abs=1e-6)
    assert torch.allclose(split.grad, whole.grad, atol=1e-6)
    assert whole.grad.abs().sum() > 0  # the loss does reach the logits


def test_moe_inputs_unchanged():
    logits = torch.randn(6, 3)
    before = logits.clone()
    load_balancing_loss([logits], 2)
    assert torch.equal(logits, before)
