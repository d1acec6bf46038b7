"""Online DPO's update step (trainers/online_dpo.py, docs/online_dpo.md) on a tiny Llama:

- one optimizer step's gradient is the same for 1 micro-batch and for micro-batches of 1
  and of 3 pairs (split invariance, docs/architecture.md section 4), and it is the
  gradient of the mean DPO loss over the untied pairs, computed here directly;
- a tied group's pair weighs nothing: its responses do not change the gradient;
- a minibatch whose pairs all tie runs no backward and takes no step;
- the labeller's statistics count ties and average the untied pairs' scores;
- a config mistake of ppo.estimator=online_dpo is one ConfigError naming the key.
"""

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlhf_dist.algo.preference import dpo_loss, sequence_logprobs
from rlhf_dist.config import ConfigError, config_from_dict, validate
from rlhf_dist.models import ActorCritic
from rlhf_dist.rollout import RolloutBatch
from rlhf_dist.stats import StatSums
from rlhf_dist.trainers.ppo.online_dpo import PairKnobs, Pairs, pair_statistics, pair_step

V, TEMPERATURE, P, T, N = 50, 0.7, 5, 6, 2


def tiny_lm(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=32, max_position_embeddings=64,
        attention_dropout=0.0, pad_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def rollout(seed: int = 1) -> RolloutBatch:
    """5 groups of 2 samples, ragged left-padded prompts and responses; group 2 ties."""
    g = torch.Generator().manual_seed(seed)
    B = 10
    lengths = torch.tensor([6, 2, 4, 1, 5, 3, 6, 4, 2, 5])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[::3, :2] = 0
    scores = torch.tensor([0.5, -1.0, 2.0, 3.0, 1.0, 1.0, -2.0, 0.0, 4.0, 1.0])
    return RolloutBatch(
        prompt_ids=torch.randint(1, V, (B, P), generator=g) * prompt_mask,
        prompt_mask=prompt_mask,
        response_ids=torch.where(mask, torch.randint(1, V, (B, T), generator=g), 0),
        response_mask=mask,
        old_logprobs=torch.where(mask, -torch.rand(B, T, generator=g) * 3, 0.0),
        ref_logprobs=torch.where(mask, -torch.rand(B, T, generator=g) * 3, 0.0),
        old_values=None,
        scores=scores,
        raw_scores=scores,
        finished=torch.ones(B, dtype=torch.bool),
        entropy=torch.zeros(B, T),
    )


class OneRank:
    """The runtime of one CPU process, as pair_step uses it."""

    world_size, rank, device = 1, 0, torch.device("cpu")

    def all_sum(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    def micro_backward(self, model, loss: torch.Tensor, last: bool) -> bool:
        loss.backward()
        return True


KNOBS = PairKnobs(beta=0.3, loss_type="sigmoid", temperature=TEMPERATURE, max_grad_norm=1.0)


def step(batch, per_micro: int, knobs=KNOBS):
    """(gradient, statistics, whether a step was taken) of one step over all pairs."""
    model = ActorCritic(tiny_lm(), None).train()
    stats = pair_step(OneRank(), model, batch, Pairs.of(batch.scores, N), per_micro, knobs)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, (stats or StatSums()).reduce(OneRank()), stats is not None


def assert_same(a: dict, b: dict, tol: float = 1e-6) -> None:
    assert a.keys() == b.keys() and len(a) > 0
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=tol, rtol=tol, msg=name)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_the_step_is_split_invariant_and_is_the_mean_loss_of_the_untied_pairs(loss_type):
    batch, knobs = rollout(), dataclasses.replace(KNOBS, loss_type=loss_type)
    whole, whole_stats, took = step(batch, 5, knobs)
    assert took
    for per_micro in (1, 3):  # 5 x 1 pair; 3 + 2 pairs
        split, split_stats, _ = step(batch, per_micro, knobs)
        assert_same(split, whole)
        assert split_stats["dpo/loss"] == pytest.approx(whole_stats["dpo/loss"], rel=1e-6)
    # the reference: one forward of all rows, the mean DPO loss over the 4 untied pairs
    model = ActorCritic(tiny_lm(), None).train()
    logprobs, *_ = model(batch.input_ids, batch.attention_mask, batch.response_mask, TEMPERATURE)
    seq = sequence_logprobs(logprobs, batch.response_mask)
    ref = sequence_logprobs(batch.ref_logprobs, batch.response_mask)
    chosen, rejected = torch.tensor([0, 3, 7, 8]), torch.tensor([1, 2, 6, 9])  # by hand
    loss, pair = dpo_loss(seq[chosen], seq[rejected], ref[chosen], ref[rejected], 0.3, loss_type)
    loss.backward()
    direct = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert_same(whole, direct, 1e-5)
    assert whole_stats["dpo/loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
    assert whole_stats["rewards/margins"] == pytest.approx(float(pair["margins"]), abs=1e-5)
    assert whole_stats["rewards/accuracy"] == pytest.approx(float(pair["accuracy"]))


def test_a_tied_pair_weighs_nothing():
    batch = rollout()
    grads, _, _ = step(batch, 2)
    other = batch.response_ids.clone()
    other[4:6] = torch.where(batch.response_mask[4:6], (other[4:6] + 7) % (V - 1) + 1, 0)
    moved, _, _ = step(dataclasses.replace(batch, response_ids=other), 2)
    assert_same(moved, grads)
    # ... while the same change on an untied pair's rows changes the step
    other = batch.response_ids.clone()
    other[2:4] = torch.where(batch.response_mask[2:4], (other[2:4] + 7) % (V - 1) + 1, 0)
    changed, _, _ = step(dataclasses.replace(batch, response_ids=other), 2)
    assert max(float((changed[n] - grads[n]).abs().max()) for n in grads) > 1e-4


def test_a_minibatch_of_ties_takes_no_step():
    batch = rollout()
    tied = dataclasses.replace(batch, scores=torch.ones(10))
    grads, stats, took = step(tied, 2)
    assert not took and grads == {} and "dpo/loss" not in stats


def test_pair_statistics_count_ties_and_average_the_labellers_scores():
    batch = rollout()
    stats = pair_statistics(OneRank(), batch, Pairs.of(batch.scores, N))
    assert stats["online_dpo/pairs"] == 4 and stats["online_dpo/tie_fraction"] == 0.2
    # chosen 0.5, 3, 0, 4; rejected -1, 2, -2, 1
    assert stats["online_dpo/score_chosen"] == pytest.approx(7.5 / 4)
    assert stats["online_dpo/score_rejected"] == pytest.approx(0.0)
    assert stats["online_dpo/score_margin"] == pytest.approx(7.5 / 4)


BASE = {
    "model": {"policy": "p", "reward": "r"},
    "data": {"train": "t"},
    "ppo": {"estimator": "online_dpo", "samples_per_prompt": 2},
}


@pytest.mark.parametrize(
    "ppo_keys, world_size, key",
    [
        ({"kl_coef": 0.0}, 1, "ppo.kl_coef"),  # beta
        ({"samples_per_prompt": 1}, 1, "ppo.samples_per_prompt"),  # no pair in a group of 1
        ({"clip_eps_high": 0.3}, 1, "ppo.clip_eps_high"),  # a knob the DPO loss does not read
        ({"entropy_coef": 0.01}, 1, "ppo.entropy_coef"),
        ({"kl_controller": "adaptive"}, 1, "ppo.kl_controller"),
        ({"overlong": "mask"}, 1, "ppo.overlong"),
        # 8 prompts x 2 over 2 ranks, minibatches of 6 sequences: 3 per rank, not whole pairs
        ({"rollout_batch_size": 6, "minibatch_size": 6}, 2, "ppo.minibatch_size"),
        ({"estimator": "grpo", "dpo_loss": "ipo"}, 1, "ppo.dpo_loss"),  # online_dpo's key only
    ],
)
def test_online_dpo_config_mistakes_name_the_key(ppo_keys, world_size, key):
    tree = {**BASE, "ppo": {**BASE["ppo"], **ppo_keys}}
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(config_from_dict(tree), "ppo", world_size)


def test_an_online_dpo_config_with_its_own_keys_validates():
    tree = {**BASE, "ppo": {**BASE["ppo"], "dpo_loss": "ipo", "overlong": "soft"}}
    validate(config_from_dict(tree), "ppo", 1)
