"""ppo.decoupled in the update (trainers/ppo/update.py, algo/policy_losses.py
decoupled_policy_terms): with the clip off the policy loss is linear in the ratio, so the
behaviour weight w = pi_prox / pi_behav scales a token's gradient by w exactly. Checked
through one optimizer step's gradient of a tiny actor: with no correction bound every token
at w = 2 doubles the gradient (AReaL's raw weight, which ppo.rollout_correction=none alone
would not apply); bounded by tis the decoupled objective is the rollout correction's; a
behaviour policy equal to the proximal one leaves the plain PPO gradient."""

import dataclasses
import math

import torch
from test_unit_rollout_correction_update import close, gradient, knobs, with_sampler


def decoupled(method: str = "none", high: float = 2.0):
    return dataclasses.replace(knobs(method, high=high), decoupled=True)


def test_the_raw_behaviour_weight_scales_every_tokens_gradient():
    batch = with_sampler(torch.full((4, 1), math.log(2.0)))  # w = 2 on every token
    plain, _ = gradient(batch, knobs())
    doubled, _ = gradient(batch, decoupled())
    close(doubled, plain, 2.0)
    capped, stats = gradient(batch, decoupled("tis", high=1.5))
    close(capped, plain, 1.5)
    corrected, _ = gradient(batch, knobs("tis", high=1.5))
    close(capped, corrected)  # bounded, it is the rollout correction's objective
    assert stats["rollout/corrected_frac"] == 1.0


def test_behaviour_equal_to_proximal_leaves_the_ppo_gradient():
    batch = with_sampler(torch.zeros(4, 1))
    plain, _ = gradient(batch, knobs())
    same, _ = gradient(batch, decoupled())
    close(same, plain)
