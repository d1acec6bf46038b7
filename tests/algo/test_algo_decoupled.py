"""Tests for the decoupled PPO objective (ppo.decoupled; algo/policy_losses.py
decoupled_policy_terms, algo/rollout_correction.py behaviour_weights): a hand-computed
case, and the properties: with the behaviour policy equal to the proximal one it is the
registered loss itself (value and gradient); otherwise each token's gradient is the
registered loss's times its behaviour weight, which carries no gradient."""

import math

import pytest
import torch

from rlhf_dist.algo.policy_losses import (
    POLICY_LOSSES,
    PolicyLossInputs,
    decoupled_policy_terms,
)
from rlhf_dist.algo.rollout_correction import behaviour_weights

LN = math.log


def test_decoupled_clip_hand_computed():
    # token 1: u = pi/pi_prox = 1.5, A = +1: min(1.5, clip 1.2) = 1.2 -> -1.2, w = 2 -> -2.4
    # token 2: u = 0.5, A = -1: max(0.5, clip 0.8) = 0.8 -> 0.8, w = 0.5 -> 0.4
    # token 3: padding (mask False): weight 1, loss as the clip gives it
    prox = torch.tensor([[LN(0.4), LN(0.2), LN(0.3)]])
    logprobs = prox + torch.tensor([[LN(1.5), LN(0.5), 0.0]])
    behav = prox - torch.tensor([[LN(2.0), LN(0.5), LN(7.0)]])  # w = pi_prox / pi_behav
    mask = torch.tensor([[True, True, False]])
    advantages = torch.tensor([[1.0, -1.0, 1.0]])
    w = behaviour_weights(prox, behav, mask)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 1.0]]))
    x = PolicyLossInputs(logprobs, prox, advantages, clip_eps_low=0.2)
    terms = decoupled_policy_terms("clip", x, w)
    torch.testing.assert_close(terms["loss"], torch.tensor([[-2.4, 0.4, -1.0]]))
    torch.testing.assert_close(terms["clipped"], torch.tensor([[1.0, 1.0, 0.0]]))
    torch.testing.assert_close(terms["ratio"], torch.tensor([[1.5, 0.5, 1.0]]))


def _random(seed: int, shape=(3, 6)):
    g = torch.Generator().manual_seed(seed)
    prox = -torch.rand(*shape, generator=g, dtype=torch.float64) * 3
    logprobs = prox + torch.randn(*shape, generator=g, dtype=torch.float64) * 0.3
    behav = prox + torch.randn(*shape, generator=g, dtype=torch.float64) * 0.5
    advantages = torch.randn(*shape, generator=g, dtype=torch.float64)
    mask = torch.rand(*shape, generator=g) < 0.8
    return logprobs, prox, behav, advantages, mask


@pytest.mark.parametrize("name", ["clip", "cispo"])
@pytest.mark.parametrize("seed", range(4))
def test_equal_behaviour_and_proximal_policies_give_the_registered_loss(name, seed):
    logprobs, prox, _, advantages, mask = _random(seed)
    grads = []
    for decoupled in (True, False):
        lp = logprobs.clone().requires_grad_(True)
        x = PolicyLossInputs(lp, prox, advantages, clip_eps_low=0.2, clip_eps_high=0.28)
        if decoupled:
            terms = decoupled_policy_terms(name, x, behaviour_weights(prox, prox, mask))
        else:
            terms = POLICY_LOSSES[name].fn(x)
        terms["loss"].sum().backward()
        grads.append((terms["loss"].detach(), lp.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=0, atol=0)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=0, atol=0)


@pytest.mark.parametrize("seed", range(4))
def test_each_tokens_gradient_is_scaled_by_its_behaviour_weight_alone(seed):
    logprobs, prox, behav, advantages, mask = _random(seed)
    w = behaviour_weights(prox, behav, mask)
    assert bool((w > 0).all()) and bool((w[~mask] == 1).all())
    torch.testing.assert_close(w[mask], torch.exp(prox - behav)[mask])
    lp = logprobs.clone().requires_grad_(True)
    x = PolicyLossInputs(lp, prox, advantages, clip_eps_low=0.2)
    decoupled = decoupled_policy_terms("clip", x, w.requires_grad_(True))
    decoupled["loss"].sum().backward()
    assert w.grad is None  # the weight is detached: it reweights, it is not optimised
    plain_lp = logprobs.clone().requires_grad_(True)
    plain = POLICY_LOSSES["clip"].fn(PolicyLossInputs(plain_lp, prox, advantages, clip_eps_low=0.2))
    plain["loss"].sum().backward()
    torch.testing.assert_close(lp.grad, w.detach() * plain_lp.grad)
    torch.testing.assert_close(decoupled["behaviour_weight"], w.detach())
