"""ppo.rollout_correction in the update (trainers/ppo/update.py::correction_weights): with the
clip off the policy loss is linear in the ratio, so a correction weight w on a token scales
that token's gradient by w exactly. Checked through one optimizer step's gradient of a
tiny actor: every token at r = pi_old / pi_rollout = 2 doubles the gradient under tis with
a cap above 2, is capped to 1.5x below it, and is masked to no gradient by mis; icepop
masks exactly the rows whose tokens fall outside its bounds."""

import dataclasses
import math

import torch
from test_unit_distill import TEMPERATURE, OneRank, rollout, tiny_lm

from rlhf_dist.models import ActorCritic
from rlhf_dist.trainers.ppo.update import UpdateKnobs, minibatch_backward


class Rank(OneRank):
    """One CPU process, as minibatch_backward and StatSums.reduce use it."""

    def all_max(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()


def knobs(method: str = "none", level: str = "token", low=0.5, high=2.0) -> UpdateKnobs:
    # no clip, no critic, no KL or entropy term: the loss is -A * ratio * w per token
    return UpdateKnobs(
        TEMPERATURE, None, None, None, None, 0.0, 0.0, 0.0, "k1", "token_mean", (1.0,),
        rollout_correction=(method, level, low, high),
    )  # fmt: skip


def gradient(batch, k: UpdateKnobs, advantages=None) -> tuple[dict, dict]:
    model = ActorCritic(tiny_lm(0), None).train()
    if advantages is None:
        g = torch.Generator().manual_seed(5)
        advantages = torch.randn(batch.response_mask.shape, generator=g)
    step = minibatch_backward(Rank(), model, batch, advantages, None, k, [slice(0, 4)])
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, step.stats.reduce(Rank())


def with_sampler(shift: torch.Tensor):
    """The test rollout with sampler log-probs = old - shift (shift (B, 1) or (B, T))."""
    batch = dataclasses.replace(rollout(), teacher_logprobs=None)
    sampler = (batch.old_logprobs - shift) * batch.response_mask
    return dataclasses.replace(batch, sampler_logprobs=sampler)


def close(a: dict, b: dict, scale: float = 1.0) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        torch.testing.assert_close(a[name], scale * b[name], atol=1e-6, rtol=1e-5, msg=name)


def test_every_token_at_ratio_two_is_weighted_capped_or_masked():
    batch = with_sampler(torch.full((4, 1), math.log(2.0)))  # r = 2 on every token
    plain, _ = gradient(batch, knobs())
    doubled, stats = gradient(batch, knobs("tis", high=3.0))
    close(doubled, plain, 2.0)
    assert stats["rollout/corrected_frac"] == 0.0
    capped, stats = gradient(batch, knobs("tis", high=1.5))
    close(capped, plain, 1.5)
    assert stats["rollout/corrected_frac"] == 1.0
    masked, _ = gradient(batch, knobs("mis", high=1.5))
    assert all(bool((g == 0).all()) for g in masked.values())  # no policy gradient left
    # at the sequence level a row's ratio is 2 ** (its token count): rows of 1 token pass
    # tis's cap of 2.5, longer ones are capped; compare with per-row advantages scaled so
    sequence, _ = gradient(batch, knobs("tis", "sequence", high=2.5))
    lengths = batch.response_mask.sum(1).float()
    weights = torch.clamp(2.0**lengths, max=2.5)[:, None]
    g = torch.Generator().manual_seed(5)
    advantages = torch.randn(batch.response_mask.shape, generator=g)
    want, _ = gradient(batch, knobs(), advantages=advantages * weights)
    close(sequence, want)


def test_icepop_masks_the_tokens_outside_its_bounds_and_only_those():
    # rows 0 and 1 sampled as the trainer would (r = 1), rows 2 and 3 at r = 3
    shift = torch.tensor([[0.0], [0.0], [math.log(3.0)], [math.log(3.0)]])
    batch = with_sampler(shift)
    g = torch.Generator().manual_seed(5)
    advantages = torch.randn(batch.response_mask.shape, generator=g)
    got, stats = gradient(batch, knobs("icepop", low=0.5, high=2.0), advantages)
    kept = advantages * torch.tensor([[1.0], [1.0], [0.0], [0.0]])
    want, _ = gradient(batch, knobs(), kept)
    close(got, want)
    mask = batch.response_mask
    assert stats["rollout/corrected_frac"] == 5 / 12  # rows 2 and 3 hold 5 of 12 tokens
    assert int(mask[2:].sum()) == 5 and int(mask.sum()) == 12
