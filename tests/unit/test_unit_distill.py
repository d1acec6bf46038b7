"""On-policy distillation's update pieces (docs/distill.md):

- engine.forward.chunked_divergence through ActorCritic.forward equals GJSD of the two
  models' whole (B, T, V) logits, in values and in every parameter's gradient, for any
  chunk size, with the teacher's padded vocabulary cut to the student's;
- the update's loss is split-invariant with the teacher's signal in it: one optimizer
  step's gradient is the same for 1 micro-batch and for 3 of ragged token counts, for the
  sampled-token reverse KL (an advantage) and for GJSD (a loss term), and the signal is
  really in that gradient.
"""

import contextlib
import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlhf_dist.algo.distill import generalized_jsd
from rlhf_dist.config import PerfConfig
from rlhf_dist.engine.forward import chunked_divergence, teacher_states
from rlhf_dist.engine.packing import position_ids_from
from rlhf_dist.models import ActorCritic
from rlhf_dist.rollout import RolloutBatch
from rlhf_dist.trainers.ppo.update import Teacher, UpdateKnobs, minibatch_backward

V, TEMPERATURE, P, T = 50, 0.7, 6, 5


def tiny_lm(seed: int, vocab: int = V, tied: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=32, max_position_embeddings=64,
        tie_word_embeddings=tied, attention_dropout=0.0, pad_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def rollout(seed: int = 1, B: int = 4) -> RolloutBatch:
    """B left-padded prompts of P tokens, responses of T with ragged masks."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 2, 4, 1][:B])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[0, :2] = 0
    return RolloutBatch(
        prompt_ids=torch.randint(1, V, (B, P), generator=g) * prompt_mask,
        prompt_mask=prompt_mask,
        response_ids=torch.where(mask, torch.randint(1, V, (B, T), generator=g), 0),
        response_mask=mask,
        old_logprobs=-torch.rand(B, T, generator=g) * 3,
        ref_logprobs=-torch.rand(B, T, generator=g) * 3,
        old_values=None,
        scores=torch.randn(B, generator=g),
        raw_scores=torch.randn(B, generator=g),
        finished=torch.ones(B, dtype=torch.bool),
        entropy=torch.zeros(B, T),
        teacher_logprobs=-torch.rand(B, T, generator=g) * 3,
    )


def whole_logits(model, batch: RolloutBatch) -> torch.Tensor:
    """The model's own (B, T, V) logits at the positions predicting the response."""
    ids, attention = batch.input_ids, batch.attention_mask
    out = model(input_ids=ids, attention_mask=attention, position_ids=position_ids_from(attention))
    return out.logits[:, -T - 1 : -1]


@pytest.mark.parametrize("chunk", [1, 3, 0])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_chunked_gjsd_equals_the_whole_logits_in_values_and_gradients(chunk, tied):
    student, teacher = ActorCritic(tiny_lm(0, tied=tied), None), tiny_lm(7, vocab=V + 3)
    batch, beta = rollout(), 0.3
    mask = batch.response_mask
    jsd = lambda s, t: generalized_jsd(s, t, beta, TEMPERATURE)  # noqa: E731
    states = teacher_states(teacher, batch.input_ids, batch.attention_mask, mask, P)
    assert states.hidden.shape == (int(mask.sum()), 16) and not states.hidden.requires_grad

    def divergence(lm, hidden):
        return chunked_divergence(lm, hidden, states, jsd, chunk)

    *_, div = student(
        batch.input_ids, batch.attention_mask, mask, TEMPERATURE, divergence=divergence
    )
    weights = torch.randn(B_T := mask.shape, generator=torch.Generator().manual_seed(3))
    (div * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}
    student.zero_grad(set_to_none=True)
    # reference: whole logits, the teacher's padded vocabulary cut to the student's 50
    with torch.no_grad():
        t_logits = whole_logits(teacher, batch)[..., :V]
    want = generalized_jsd(
        whole_logits(student.actor, batch)[mask], t_logits[mask], beta, TEMPERATURE
    )
    (want * weights[mask]).sum().backward()
    torch.testing.assert_close(div[mask], want, atol=1e-6, rtol=1e-6)
    assert div.shape == B_T and bool((div[~mask] == 0).all())
    ref = {n: p.grad for n, p in student.named_parameters() if p.grad is not None}
    assert grads.keys() == ref.keys() and "actor.model.embed_tokens.weight" in grads
    for name in ref:
        torch.testing.assert_close(grads[name], ref[name], atol=1e-6, rtol=1e-6, msg=name)


class OneRank:
    """The runtime of one CPU process, as minibatch_backward uses it."""

    world_size, rank, device = 1, 0, torch.device("cpu")

    def all_sum(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    def micro_backward(self, model, loss: torch.Tensor, last: bool) -> bool:
        loss.backward()
        return True

    def pool_micro_batches(self, items: list) -> list:
        return [(True, x) for x in items]  # no sequence parallelism: this rank's own

    def sequence_parallel(self):
        return contextlib.nullcontext()


def step_gradient(batch, slices, knobs, teacher) -> dict[str, torch.Tensor]:
    """The gradient one optimizer step accumulates over `slices` of `batch`."""
    model = ActorCritic(tiny_lm(0), None).train()
    advantages = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(5))
    minibatch_backward(OneRank(), model, batch, advantages, None, knobs, slices, teacher=teacher)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def knobs_for(loss: str, coef: float, aggregation: str = "token_mean") -> UpdateKnobs:
    return UpdateKnobs(
        TEMPERATURE, 0.2, 0.2, None, None, 0.0, 0.0, 0.0, "k1", aggregation, (1.0,),
        distill_coef=coef, distill_loss=loss, distill_beta=0.5,
    )  # fmt: skip


@pytest.mark.parametrize("loss", ["reverse_kl", "gjsd"])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_the_distillation_loss_is_split_invariant_and_carries_the_teacher(loss, aggregation):
    batch = rollout()
    teacher = Teacher(tiny_lm(7), PerfConfig(logprob_chunk_tokens=2))
    knobs = knobs_for(loss, 0.7, aggregation)
    whole = step_gradient(batch, [slice(0, 4)], knobs, teacher)
    split = step_gradient(batch, [slice(0, 1), slice(1, 3), slice(3, 4)], knobs, teacher)
    assert whole.keys() == split.keys() and len(whole) > 0
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], atol=1e-6, rtol=1e-6, msg=name)
    # the teacher's signal is in the gradient: without it (coef 0) the step differs
    plain = step_gradient(batch, [slice(0, 4)], knobs_for(loss, 0.0, aggregation), teacher)
    diff = max(float((whole[n] - plain[n]).abs().max()) for n in whole)
    assert diff > 1e-4
    if loss == "reverse_kl":  # a signal from the rollout's teacher log-probs alone
        moved = dataclasses.replace(batch, teacher_logprobs=batch.teacher_logprobs - 1.0)
        other = step_gradient(moved, [slice(0, 4)], knobs, teacher)
        assert max(float((whole[n] - other[n]).abs().max()) for n in whole) > 1e-4
