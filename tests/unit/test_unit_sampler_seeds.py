"""Sampler.sample's `seeds` and `logprobs` (generation/base.py): what the rollout server
asks of the samplers it shares with the trainer (serving/policy.py)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlhf_dist.config import GenerationConfig, PerfConfig
from rlhf_dist.engine.decode import generate, truncate_after_eos
from rlhf_dist.engine.forward import token_logprobs
from rlhf_dist.generation import Samples
from rlhf_dist.generation.hf import HFSampler, _PadOnly
from rlhf_dist.generation.server import _no_seeds
from rlhf_dist.generation.vllm import group_seeds, sampling_seeds

PAD, STOP = 0, (1,)
IDS = torch.tensor([[0, 0, 4, 5], [0, 7, 8, 9], [3, 4, 5, 6], [0, 0, 0, 9], [0, 0, 2, 3]])
MASK = (IDS != PAD).long()
GEN = GenerationConfig(max_new_tokens=10, temperature=0.8, min_new_tokens=1)


@pytest.fixture(scope="module")
def model():
    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def sampler(model) -> HFSampler:
    return HFSampler(lambda: contextlib.nullcontext((model, None)), PerfConfig())


def test_one_seeded_group_samples_what_the_global_rng_seeded_alike_samples(model):
    torch.manual_seed(11)
    before = torch.random.get_rng_state()
    got = sampler(model).sample(IDS, MASK, GEN, STOP, PAD, seeds=[(5, len(IDS))])
    assert torch.equal(torch.random.get_rng_state(), before)  # the global RNG left alone
    torch.manual_seed(5)
    alone = generate(model, IDS, MASK, GEN, _PadOnly(PAD), None, STOP, PerfConfig())
    assert torch.equal(got.response_ids, alone)
    assert got.logprobs is None and got.versions is None


def test_seeded_groups_draw_from_generators_of_their_own(model):
    seeds = [(3, 2), (9, 1), (3, 2)]
    got = sampler(model).sample(IDS, MASK, GEN, STOP, PAD, seeds=seeds)
    streams = [(torch.Generator().manual_seed(s), n) for s, n in seeds]
    want = generate(model, IDS, MASK, GEN, _PadOnly(PAD), None, STOP, PerfConfig(), streams)
    assert torch.equal(got.response_ids, want)


def test_seeds_with_several_passes_are_refused(model):
    with pytest.raises(ValueError, match="one pass"):
        sampler(model).sample(IDS, MASK, GEN, STOP, PAD, rows_per_pass=2, seeds=[(1, 5)])


@pytest.mark.parametrize("rows_per_pass", [None, 2])
def test_asked_log_probs_are_the_actor_forward_of_the_cut_responses(model, rows_per_pass):
    torch.manual_seed(4)
    plain = sampler(model).sample(IDS, MASK, GEN, STOP, PAD, rows_per_pass)
    torch.manual_seed(4)
    got = sampler(model).sample(IDS, MASK, GEN, STOP, PAD, rows_per_pass, logprobs=True)
    ids, response_mask, _ = truncate_after_eos(plain.response_ids, STOP, PAD)
    assert torch.equal(got.response_ids, ids)
    assert got.logprobs is not None and got.logprobs.dtype == torch.float32
    with torch.no_grad():
        want, _ = token_logprobs(
            model, torch.cat([IDS, ids], 1), torch.cat([MASK, response_mask.long()], 1),
            response_mask, GEN.temperature, prompt_width=IDS.shape[1],
        )  # fmt: skip
    assert torch.allclose(got.logprobs, want.float(), atol=1e-6)
    assert bool((got.logprobs[~response_mask] == 0).all())
    assert bool((got.logprobs[response_mask] < 0).all())


def test_vllm_group_seeds_are_the_global_rng_draws_of_each_groups_seed():
    before = torch.random.get_rng_state()
    got = group_seeds([(7, 3), (2, 1)])
    assert torch.equal(torch.random.get_rng_state(), before)
    want = []
    for seed, n in [(7, 3), (2, 1)]:
        torch.manual_seed(seed)
        want += sampling_seeds(n).tolist()
    torch.random.set_rng_state(before)
    assert got == want


def test_the_servers_client_refuses_seeds():
    _no_seeds(None)
    with pytest.raises(ValueError, match="draws each shard's seed itself"):
        _no_seeds([(1, 2)])


class _Recording:
    """A Sampler's `sample` that records what the served policy asks of it and answers
    two fixed rows, the first ending with `stop`."""

    def __init__(self, stop: int) -> None:
        self.calls: list[dict] = []
        self.rows = torch.tensor([[5, 6, stop, 7], [8, 9, 9, 9]])

    def sample(self, ids, mask, gen, stop_ids, pad_id, rows_per_pass=None, seeds=None,
               logprobs=False, media=None) -> Samples:  # fmt: skip
        assert media is None  # a text model: no images reach the sampler
        self.calls.append({"rows": ids.shape[0], "seeds": seeds, "logprobs": logprobs})
        out = self.rows[: ids.shape[0]]
        lp = torch.arange(1, out.numel() + 1, dtype=torch.float32).reshape(out.shape) / -8
        return Samples(out, lp, torch.full((ids.shape[0],), 3))


def test_the_served_policy_generates_through_its_one_sampler(tmp_path):
    from test_unit_serve import sampling, tiny_served_policy

    policy = tiny_served_policy(tmp_path)
    stop = policy.stop_ids[0]
    assert stop not in (5, 6, 8, 9)
    policy.sampler = fake = _Recording(stop)
    got = policy.generate([[4, 5], [6]], sampling(seed=12), [(12, 1), (30, 1)])
    assert fake.calls == [{"rows": 2, "seeds": [(12, 1), (30, 1)], "logprobs": True}]
    assert got == {
        "responses": [[5, 6, stop], [8, 9, 9, 9]],  # cut after the stop id
        "logprobs": [[-0.125, -0.25, -0.375], [-0.625, -0.75, -0.875, -1.0]],
        "finished": [True, False],
        "version": 0,  # the served weights' version, not the sampler's
    }
    policy.generate([[4, 5]], sampling(seed=12))
    assert fake.calls[-1]["seeds"] == [(12, 1)]  # a request alone: its own seed, its rows
