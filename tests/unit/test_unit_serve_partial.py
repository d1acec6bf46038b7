"""Partial rollouts on the served policy (serving/partial.py): an update that lands while a
response is decoded is swapped in at a step boundary, and every token keeps the version and
the behaviour log-prob it was sampled with."""

import copy

import pytest
import torch


def tiny_policy(tmp_path):
    """A ServedPolicy of a random one-layer Llama over the demo's word-level tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf_dist.config import PerfConfig
    from rlhf_dist.demo.task import build_tokenizer
    from rlhf_dist.serving.policy import ServedPolicy

    tok = build_tokenizer(tmp_path / "tok")
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    torch.manual_seed(0)
    return ServedPolicy(LlamaForCausalLM(cfg), tok, (tok.eos_token_id,), PerfConfig(), "p", 5.0)


def request(**keys):
    from rlhf_dist.serving.policy import SamplingRequest

    return SamplingRequest(**({"max_new_tokens": 8, "min_new_tokens": 8, "temperature": 0.7,
                               "top_k": 0, "top_p": 1.0, "seed": 3, "partial": True} | keys))  # fmt: skip


def update_of(policy, scale=0.3):
    """A whole update: every weight moved by `scale` of random noise, as received tensors."""
    from rlhf_dist.serving.policy import TensorSpec

    g = torch.Generator().manual_seed(1)
    return [
        (TensorSpec(n, tuple(p.shape), "float32"), p.detach() + scale * torch.randn(p.shape, generator=g))
        for n, p in policy.model.named_parameters()
    ]  # fmt: skip


def response_logprobs(model, prompt, response, temperature):
    """log softmax(logits / T) of each response token under `model`'s full forward."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(1, torch.tensor(response)[:, None])[:, 0]


def test_an_update_landing_mid_response_serves_the_rest_from_the_new_weights(tmp_path):
    """The update is staged during the third forward (prefill + 2 steps): tokens 0-2 are
    version 0, tokens 3.. version 1; each token's log-prob is its own version's forward
    (the new tokens after a recomputed KV cache), and the next request samples version 1."""
    policy = tiny_policy(tmp_path)
    old = copy.deepcopy(policy.model)
    update = update_of(policy)
    forwards = {"n": 0}
    forward = policy.model.forward

    def counting(*args, **kwargs):
        out = forward(*args, **kwargs)
        forwards["n"] += 1
        if forwards["n"] == 3:  # the sync thread, between this forward and the next
            policy.staging.add(1, update, final=True)
        return out

    policy.model.forward = counting
    prompts = [[4, 5, 6], [7, 8]]
    got = policy.generate(prompts, request())
    del policy.model.forward
    assert got["versions"] == [[0, 0, 0, 1, 1, 1, 1, 1]] * 2
    assert got["version"] == policy.version == 1
    for prompt, response, lp in zip(prompts, got["responses"], got["logprobs"]):
        lp = torch.tensor(lp)
        before = response_logprobs(old, prompt, response, 0.7)[:3]
        after = response_logprobs(policy.model, prompt, response, 0.7)[3:]
        torch.testing.assert_close(lp[:3], before, atol=1e-5, rtol=0)
        torch.testing.assert_close(lp[3:], after, atol=1e-5, rtol=0)
        # the old weights would not have given the tokens after the swap these log-probs
        assert not torch.allclose(lp[3:], response_logprobs(old, prompt, response, 0.7)[3:])
    assert policy.generate(prompts, request(seed=4))["versions"] == [[1] * 8] * 2


def test_partial_updates_never_tear_and_land_when_idle(tmp_path):
    """A staged update swaps in whole: not before its final bucket (a trainer that dies
    mid-update leaves the served version as it was), at once when nothing decodes, and
    a response sampled without an update has one version throughout, the same tokens and
    log-probs as the plain request."""
    policy = tiny_policy(tmp_path)
    update = update_of(policy)
    half = len(update) // 2
    policy.staging.add(1, update[:half], final=False)
    policy._swap_when_idle()
    assert policy.version == 0
    plain = policy.generate([[4, 5, 6]], request(partial=False))
    partial = policy.generate([[4, 5, 6]], request())
    assert partial["responses"] == plain["responses"] and partial["versions"] == [[0] * 8]
    torch.testing.assert_close(partial["logprobs"], plain["logprobs"], atol=1e-5, rtol=0)
    policy.staging.add(2, update, final=True)  # a newer update: the torn one's buckets go
    policy._swap_when_idle()
    assert policy.version == 2
    for spec, tensor in update:
        assert torch.equal(policy.params[spec.name], tensor)


def test_a_partial_request_the_policy_cannot_serve_is_refused(tmp_path):
    from rlhf_dist.serving.policy import BadRequest

    policy = tiny_policy(tmp_path)
    with pytest.raises(BadRequest, match="sampling.partial"):
        policy.generate([[4, 5]], request(routing=True))


def _tree(generation=None, **ppo):
    return {"model": {"policy": "p", "reward": "r"}, "data": {"train": "t.jsonl"},
            "generation": generation or {}, "ppo": ppo}  # fmt: skip


def test_partial_rollouts_need_servers_k_ahead_and_one_trainer_process():
    """ppo.partial_rollouts: a one-line ConfigError naming it without the servers, without
    max_staleness >= 1, or with several trainer processes; accepted with k >= 1."""
    from types import SimpleNamespace

    from rlhf_dist.config import config_from_dict, validate
    from rlhf_dist.errors import ConfigError
    from rlhf_dist.generation.prefetch import server_all_max

    server = {"backend": "server", "server_urls": ["http://127.0.0.1:1"]}
    for tree in (
        _tree(partial_rollouts=True, max_staleness=1),
        _tree(server, partial_rollouts=True),
    ):
        with pytest.raises(
            ConfigError,
            match=r"^ppo.partial_rollouts: needs generation.backend=server and ppo.max_staleness >= 1",
        ):
            validate(config_from_dict(tree), "ppo")
    endpoint = server | {"environment": "m:f", "environment_endpoint": True}
    for multi_turn in (endpoint, server | {"environment": "m:f"}):
        with pytest.raises(
            ConfigError, match=r"^ppo.partial_rollouts: not with multi-turn episodes"
        ):
            tree = _tree(multi_turn, partial_rollouts=True, max_staleness=1)
            validate(config_from_dict(tree), "ppo")
    cfg = config_from_dict(_tree(server, partial_rollouts=True, max_staleness=1))
    validate(cfg, "ppo")
    assert cfg.ppo.partial_rollouts and not config_from_dict(_tree(server)).ppo.partial_rollouts
    with pytest.raises(ConfigError, match=r"^ppo.partial_rollouts: one trainer process only"):
        server_all_max(SimpleNamespace(world_size=2), 1, partial=True)
    assert server_all_max(SimpleNamespace(world_size=1), 1, partial=True)[1]  # deferred syncs
