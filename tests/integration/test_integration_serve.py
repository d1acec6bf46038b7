"""`rlhf-dist serve` and generation.backend=server (docs/serving.md), against a real server
process on a free port serving the tiny random policy:

- /health is open; generation, scoring and weight updates refuse a missing or wrong token;
- malformed bodies (types, ranges, token ids outside the vocabulary, weight metadata that
  does not fit the model) are 4xx answers naming the problem, and the server keeps serving;
- /generate equals the in-process decode loop at the same seed, token for token, and its
  log-probs are the trainer's own at the sampling temperature (1e-5: two processes, same
  kernels and thread count, so the tokens are identical and the log-probs differ by
  rounding at most);
- a weight update (several buckets) bumps the version, and the served tokens become those
  of the updated model; a skipped update is caught by the post-sync check;
- GRPO runs two iterations with its rollouts served, and the actor trains;
- with ppo.max_staleness=1 no rollout older than one update is trained on, and a run
  killed with a rollout in flight resumes to the unbroken run's metrics.
"""

from __future__ import annotations

import dataclasses
import json
import urllib.error
import urllib.request

import pytest
import torch
from faults import Killed, kill_at, untimed
from serve_process import client, served

from rlhf_dist.config import config_from_dict
from rlhf_dist.data.rows import left_pad
from rlhf_dist.engine.decode import generate, truncate_after_eos
from rlhf_dist.engine.forward import token_logprobs
from rlhf_dist.errors import ServerError
from rlhf_dist.generation.server import ServerEngine
from rlhf_dist.models.loading import load_causal_lm, load_tokenizer

TOKEN = "test-token-7c1e"  # the shared secret of this module's server
ENV = "RLHF_DIST_TEST_SERVER_TOKEN"
# The served chat template: the demo's word-level tokenizer has none and no role tokens, so
# a user turn renders as its words and "good" opens the answer (CHAT_TEMPLATE_TEXT).
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}good{% endif %}"
)
CHAT_TEMPLATE_TEXT = "{} good"


@pytest.fixture(scope="module")
def server(task_env):
    """A `rlhf-dist serve` process of the tiny policy on a free port; its URL."""
    tree = {"model": {"policy": str(task_env.policy)}, "serve": {"max_batch": 16},
            "perf": {"num_threads": 1}, "distributed": {"timeout_s": 60},
            "data": {"chat_template": CHAT_TEMPLATE}}  # fmt: skip
    with served(tree, ENV, TOKEN) as url:
        yield url


def _call(url, path, body=None, token=TOKEN, raw: bytes | None = None):
    """(status, JSON answer) of one call; body None and raw None: a GET."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url + path, data, headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _sampling(**keys):
    return {"max_new_tokens": 12, "temperature": 0.7, "seed": 123} | keys


def _prompts(tokenizer):
    texts = ["the food was", "i think the service", "a great", "we loved it"]
    return [tokenizer(t)["input_ids"] for t in texts]


def test_health_is_open_and_everything_else_needs_the_token(server, task_env):
    status, health = _call(server, "/health", token="")
    assert status == 200 and health["model"] == str(task_env.policy)
    assert isinstance(health["version"], int)
    prompts = _prompts(task_env.tokenizer)
    body = {"prompts": prompts, "sampling": _sampling()}
    no_scheme = urllib.request.Request(
        server + "/generate", json.dumps(body).encode(),
        {"Content-Type": "application/json", "Authorization": TOKEN},
    )  # fmt: skip
    with pytest.raises(urllib.error.HTTPError, match="401"):
        urllib.request.urlopen(no_scheme, timeout=60)
    for token in ("", "wrong-token"):
        assert _call(server, "/generate", body, token=token)[0] == 401
        assert _call(server, "/score", {"sequences": prompts}, token=token)[0] == 401
        update = {"version": 99, "tensors": [{"name": "x", "shape": [1], "dtype": "float32"}]}
        assert _call(server, "/update_weights", update, token=token)[0] == 401
    assert _call(server, "/generate", body)[0] == 200


@pytest.mark.parametrize(
    "path, body, status, detail",
    [
        ("/generate", {"prompts": [[1, 2]]}, 422, "sampling"),
        ("/generate", {"prompts": [["a", 2]], "sampling": _sampling()}, 422, "prompts"),
        ("/generate", {"prompts": [], "sampling": _sampling()}, 422, "prompts"),
        ("/generate", {"prompts": [[]], "sampling": _sampling()}, 400, "empty"),
        ("/generate", {"prompts": [[1, 10**7]], "sampling": _sampling()}, 400, "outside"),
        ("/generate", {"prompts": [[1, -3]], "sampling": _sampling()}, 400, "outside"),
        ("/generate", {"prompts": [[1, 2]], "sampling": _sampling(temperature=-1)}, 422, "temperature"),
        ("/generate", {"prompts": [[1, 2]], "sampling": _sampling(max_new_tokens=10**6)}, 400, "max_new_tokens"),
        ("/generate", {"prompts": [[1, 2]] * 17, "sampling": _sampling()}, 413, "max_batch"),
        ("/score", {"sequences": [[5]]}, 400, "at least 2"),
        ("/update_weights", {"version": 99, "tensors": [{"name": "nope", "shape": [1], "dtype": "float32"}]}, 400, "no parameter"),
        ("/update_weights", {"version": 99, "tensors": [{"name": "model.norm.weight", "shape": [3, 3], "dtype": "float32"}]}, 400, "shape"),
        ("/update_weights", {"version": 99, "tensors": [{"name": "model.norm.weight", "shape": [64], "dtype": "int8"}]}, 400, "dtype"),
        ("/update_weights", {"version": 0, "tensors": [{"name": "model.norm.weight", "shape": [64], "dtype": "float32"}]}, 422, "version"),
        ("/init_weight_sync", {"address": "127.0.0.1", "port": 1234, "rank": 3, "world_size": 2}, 400, "rank"),
    ],
)  # fmt: skip
def test_malformed_requests_are_4xx_and_the_server_keeps_serving(
    server, task_env, path, body, status, detail
):
    got, answer = _call(server, path, body)
    assert got == status, answer
    assert detail in json.dumps(answer)
    ok, _ = _call(server, "/generate", {"prompts": [[1, 2, 3]], "sampling": _sampling()})
    assert ok == 200


def test_a_body_that_is_not_json_is_a_422(server):
    assert _call(server, "/generate", raw=b"{not json")[0] == 422


def _policy(task_env):
    return load_causal_lm(str(task_env.policy), "model.policy").eval()


def test_served_generation_equals_in_process_generation_at_the_same_seed(server, task_env):
    tok = load_tokenizer(str(task_env.policy))
    prompts, stops = _prompts(tok), [tok.eos_token_id]
    status, answer = _call(
        server, "/generate", {"prompts": prompts, "sampling": _sampling(stop_token_ids=stops)}
    )
    assert status == 200
    model, (ids, mask) = _policy(task_env), left_pad(prompts, tok.pad_token_id)
    gen = config_from_dict({"generation": {"max_new_tokens": 12, "temperature": 0.7}}).generation
    torch.set_num_threads(1)
    torch.manual_seed(123)
    out = generate(model, ids, mask, gen, tok, None, tuple(stops))
    out, response_mask, _ = truncate_after_eos(out, tuple(stops), tok.pad_token_id)
    ours = [row[m].tolist() for row, m in zip(out, response_mask)]
    assert answer["responses"] == ours
    lp, _ = token_logprobs(
        model, torch.cat([ids, out], 1), torch.cat([mask, response_mask.long()], 1),
        response_mask, 0.7,
    )  # fmt: skip
    for row, m, theirs in zip(lp, response_mask, answer["logprobs"]):
        torch.testing.assert_close(torch.tensor(theirs), row[m], atol=1e-5, rtol=0)


def _client(server, **generation) -> ServerEngine:
    return client(server, ENV, **generation)


def _perturbed(task_env, seed: int):
    model = _policy(task_env)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5 * p.std().clamp(min=1e-3))
    return model


def test_a_weight_update_bumps_the_version_and_changes_what_is_served(
    server, task_env, monkeypatch
):
    monkeypatch.setenv(ENV, TOKEN)
    tok = task_env.tokenizer
    ids, mask = left_pad(_prompts(tok), tok.pad_token_id)
    greedy = config_from_dict({"generation": {"max_new_tokens": 10, "top_k": 1}}).generation
    stops = (tok.eos_token_id,)
    before_version = _call(server, "/health")[1]["version"]
    engine = _client(server, server_sync_bucket_mb=0.01)  # many buckets of the tiny model
    engine.version = before_version
    served_before, _ = engine.generate(ids, mask, greedy, stops, tok.pad_token_id)
    actor = _perturbed(task_env, seed=1)
    engine.load_weights(actor)  # the post-sync check passes inside
    assert engine.version == before_version + 1
    assert _call(server, "/health")[1]["version"] == before_version + 1
    served, logprobs = engine.generate(ids, mask, greedy, stops, tok.pad_token_id)
    ours, _, _ = truncate_after_eos(
        generate(actor, ids, mask, greedy, tok, None, stops), stops, tok.pad_token_id
    )
    width = served.shape[1]
    assert served.tolist() == ours[:, :width].tolist() and not bool(
        (ours[:, width:] != tok.pad_token_id).any()
    )
    assert served.tolist() != served_before.tolist()
    assert logprobs.shape == served.shape


@pytest.mark.slow  # a second server process starts (~10-20 s on 2 cores)
def test_two_servers_behind_one_client_each_get_the_update_and_serve_a_shard(
    server, task_env, monkeypatch
):
    """Data-parallel servers: one weight-sync group of the trainer and both servers (world
    3), both checked after the sync, the rows cut into two shards and put back in order."""
    monkeypatch.setenv(ENV, TOKEN)
    tok = task_env.tokenizer
    ids, mask = left_pad(_prompts(tok) * 2, tok.pad_token_id)  # 8 rows: 4 per server
    greedy = config_from_dict({"generation": {"max_new_tokens": 10, "top_k": 1}}).generation
    stops, pad = (tok.eos_token_id,), tok.pad_token_id
    tree = {"model": {"policy": str(task_env.policy)}, "perf": {"num_threads": 1}}
    with served(tree, ENV, TOKEN) as second:
        engine = _client(server, server_urls=[server, second])
        actor = _perturbed(task_env, seed=3)
        engine.load_weights(actor)  # the post-sync check runs against both servers
        versions = {_call(url, "/health")[1]["version"] for url in (server, second)}
        assert versions == {engine.version}
        served_ids, _ = engine.generate(ids, mask, greedy, stops, pad)
    ours, _, _ = truncate_after_eos(
        generate(actor, ids, mask, greedy, tok, None, stops), stops, pad
    )
    assert served_ids.tolist() == ours[:, : served_ids.shape[1]].tolist()


def test_the_post_sync_check_catches_a_skipped_weight_update(server, task_env, monkeypatch):
    monkeypatch.setenv(ENV, TOKEN)
    monkeypatch.setenv("RLHF_DIST_FAULT", "skip_weight_sync:1")
    engine = _client(server)
    with pytest.raises(ServerError, match="post-sync check: .* does not hold the trained weights"):
        engine.load_weights(_perturbed(task_env, seed=2))


def _grpo_config(server, policy, out, task_env, data_cfg, **ppo):
    return config_from_dict(
        {
            "run": {"output_dir": str(out), "seed": 0, "log_every": 1},
            "model": {"policy": str(policy)},
            "data": data_cfg(train=str(task_env.files.prompts)),
            "generation": {"max_new_tokens": 16, "temperature": 0.7, "backend": "server",
                           "server_urls": [server], "server_token_env": ENV},
            "reward": {"function": "rlhf_dist.demo.task:positive_word_reward"},
            "ppo": {"iterations": 2, "rollout_batch_size": 4, "samples_per_prompt": 4,
                    "rollout_micro_batch_size": 16, "ppo_epochs": 1, "minibatch_size": 16,
                    "micro_batch_size": 8, "optim": {"lr": 1e-3}, "kl_coef": 0.0,
                    "estimator": "grpo", **ppo},
            "distributed": {"timeout_s": 60},
        }
    )  # fmt: skip


def test_grpo_trains_on_served_rollouts(
    server, sft_run, task_env, runtime, tmp_path, monkeypatch, data_cfg, saved_state_dict,
    read_jsonl,
):  # fmt: skip
    from rlhf_dist.trainers.ppo import train_ppo

    monkeypatch.setenv(ENV, TOKEN)
    version = _call(server, "/health")[1]["version"]
    policy = sft_run.out / "final"
    train_ppo(
        _grpo_config(server, policy, tmp_path / "grpo", task_env, data_cfg, tis_cap=2.0), runtime
    )
    assert _call(server, "/health")[1]["version"] == version + 2  # one sync per rollout
    before = saved_state_dict(policy)
    after = saved_state_dict(tmp_path / "grpo" / "final")
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the actor trained
    # The served log-probs are the trainer's own (fp32, CPU): the sampler gap is rounding.
    logged = [
        r
        for r in read_jsonl(tmp_path / "grpo" / "metrics.jsonl")
        if "rollout/sampler_logprob_absdiff" in r
    ]
    assert len(logged) == 2 and all(r["rollout/sampler_logprob_absdiff"] < 1e-4 for r in logged)
    assert all(r["rollout/corrected_frac"] == 0.0 for r in logged)
    assert [r["rollout/policy_version"] for r in logged] == [version + 1, version + 2]
    assert all(r["rollout/server_sync_gap"] < 1e-4 and r["time/weight_sync"] > 0 for r in logged)


def test_grpo_with_lora_sends_the_base_once_then_only_the_adapters(
    server, sft_run, task_env, runtime, tmp_path, monkeypatch, data_cfg, read_jsonl
):
    """lora.enabled against a server that served other weights before: the first sync
    sends the frozen base whole and the adapters, every later one only the adapters,
    which the server folds in; the post-sync check and the sampler log-probs agree with
    the trainer's adapted actor every iteration (fp32: rounding only)."""
    from rlhf_dist.trainers.ppo import train_ppo

    monkeypatch.setenv(ENV, TOKEN)
    syncs, send = [], ServerEngine._send_bucket

    def recorded(engine, bucket, final):
        if not syncs or syncs[-1][-1]:
            syncs.append([])
        syncs[-1] += [role for (_, role, _), _ in bucket] + [final]
        return send(engine, bucket, final)

    monkeypatch.setattr(ServerEngine, "_send_bucket", recorded)
    cfg = _grpo_config(server, sft_run.out / "final", tmp_path / "lora", task_env, data_cfg,
                       iterations=3)  # fmt: skip
    cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, enabled=True, r=4, alpha=8))
    train_ppo(cfg, runtime)
    roles = [[r for r in sync if r is not True and r is not False] for sync in syncs]
    assert len(roles) == 3 and "" in roles[0] and "A" in roles[0]
    assert all(set(r) == {"A", "B"} for r in roles[1:])
    rows = [
        r for r in read_jsonl(tmp_path / "lora" / "metrics.jsonl") if "rollout/server_sync_gap" in r
    ]
    assert len(rows) == 3
    assert all(r["rollout/server_sync_gap"] < 1e-4 for r in rows)
    assert all(r["rollout/sampler_logprob_absdiff"] < 1e-4 for r in rows)


def test_a_skipped_sync_stops_grpo_with_the_last_iteration_checkpointed_and_it_resumes(
    server, sft_run, task_env, runtime, tmp_path, monkeypatch, data_cfg
):
    from rlhf_dist.trainers.ppo import train_ppo

    monkeypatch.setenv(ENV, TOKEN)
    monkeypatch.setenv("RLHF_DIST_FAULT", "skip_weight_sync:2")  # the second rollout's sync
    out = tmp_path / "grpo"
    cfg = _grpo_config(server, sft_run.out / "final", out, task_env, data_cfg)
    with pytest.raises(
        ServerError, match="post-sync check: .*iteration 1 and all before it are checkpointed"
    ):
        train_ppo(cfg, runtime)
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-000001"]
    monkeypatch.delenv("RLHF_DIST_FAULT")
    resumed = train_ppo(
        dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, resume="auto")), runtime
    )
    assert resumed["iterations"] == 2 and (out / "final").is_dir()


def test_grpo_one_step_off_policy_never_trains_on_a_rollout_older_than_one_update(
    server, sft_run, task_env, runtime, tmp_path, monkeypatch, data_cfg, saved_state_dict,
    read_jsonl,
):  # fmt: skip
    # ppo.max_staleness=1: iteration k+1's rollout is sampled while k trains
    from rlhf_dist.trainers.ppo import train_ppo

    monkeypatch.setenv(ENV, TOKEN)
    version = _call(server, "/health")[1]["version"]
    policy, out = sft_run.out / "final", tmp_path / "async"
    cfg = _grpo_config(server, policy, out, task_env, data_cfg, iterations=3, max_staleness=1,
                       rollout_correction="tis")  # fmt: skip
    train_ppo(cfg, runtime)
    assert _call(server, "/health")[1]["version"] == version + 3  # one sync per iteration
    before, after = saved_state_dict(policy), saved_state_dict(out / "final")
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the actor trained
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "rollout/staleness_max" in r]
    # iteration 1 samples on-policy; iteration k > 1 trains what the weights of k - 1
    # sampled (their version), never anything older
    assert [r["rollout/staleness_max"] for r in rows] == [0, 1, 1]
    assert [r["rollout/policy_version"] for r in rows] == [version + 1, version + 1, version + 2]
    assert all(r["rollout/stale_dropped"] == 0 and r["time/generate_request"] > 0 for r in rows)
    assert all(0 <= r["rollout/corrected_frac"] <= 1 for r in rows)
    # the stale rollouts' sampler is one update behind the trainer's old log-probs
    assert rows[0]["rollout/sampler_logprob_absdiff"] < 1e-4
    assert all(r["rollout/sampler_logprob_absdiff"] > 1e-4 for r in rows[1:])


def test_one_step_off_policy_killed_with_a_rollout_in_flight_resumes_to_the_same_metrics(
    server, sft_run, task_env, runtime, tmp_path, monkeypatch, data_cfg, read_jsonl
):
    # Killed (tests/faults.py: where RLHF_DIST_FAULT would SIGKILL) in iteration 3, with
    # iteration 4's rollout in flight; resumed from the checkpoint of iteration 2, the run
    # logs what an unbroken run logs (the servers' version counter aside).
    from rlhf_dist.trainers.ppo import recipe as ppo_module

    monkeypatch.setenv(ENV, TOKEN)

    def config(out):
        cfg = _grpo_config(server, sft_run.out / "final", out, task_env, data_cfg, iterations=4,
                           max_staleness=1)  # fmt: skip
        return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, checkpoint_every=2))

    def logged(out):
        rows = untimed(read_jsonl(out / "metrics.jsonl"))
        return [{k: v for k, v in r.items() if k != "rollout/policy_version"} for r in rows]

    ppo_module.train_ppo(config(tmp_path / "unbroken"), runtime)
    cfg = config(tmp_path / "killed")
    with monkeypatch.context() as m:
        kill_at(m, ppo_module, "rollout", 3)
        with pytest.raises(Killed):
            ppo_module.train_ppo(cfg, runtime)
    ppo_module.train_ppo(
        dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, resume="auto")), runtime
    )
    unbroken, resumed = logged(tmp_path / "unbroken"), logged(tmp_path / "killed")
    assert [r["rollout/staleness_max"] for r in unbroken] == [0, 1, 0, 1]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert resumed == unbroken


@pytest.mark.slow  # three trainer processes (~10 s of start-up each)
def test_one_step_off_policy_sigkilled_mid_sync_resumes_to_the_same_metrics(
    server, sft_run, task_env, tmp_path, data_cfg, read_jsonl
):
    """The test above with real processes, the kill in the middle of iteration 3's weight
    sync (`rlhf-dist ppo` SIGKILLed by RLHF_DIST_FAULT after the sync's first bucket): the
    server reports the torn update and answers 503 instead of serving those weights, and
    the run resumed by the same command with run.resume=auto syncs whole and serves again,
    to the unbroken run's metrics. A real SIGKILL with rollouts in flight is
    test_integration_staleness.py's (k = 4, the same prefetcher and deferred syncs)."""
    import os
    import signal
    import subprocess
    import sys

    def run(out, *extra, fault=""):
        cfg = _grpo_config(server, sft_run.out / "final", out, task_env, data_cfg,
                           iterations=4, max_staleness=1)  # fmt: skip
        tree = dataclasses.asdict(cfg)
        tree["run"]["checkpoint_every"] = 2
        tree["generation"]["server_sync_bucket_mb"] = 0.25  # several buckets per sync
        path = tmp_path / f"{out.name}.json"
        path.write_text(json.dumps(tree))
        env = os.environ | {ENV: TOKEN, "OMP_NUM_THREADS": "1", "RLHF_DIST_FAULT": fault}
        cmd = [sys.executable, "-m", "rlhf_dist", "ppo", "--config", str(path), *extra]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)

    def logged(out):
        rows = untimed(read_jsonl(out / "metrics.jsonl"))
        return [{k: v for k, v in r.items() if k != "rollout/policy_version"} for r in rows]

    assert run(tmp_path / "unbroken").returncode == 0
    unbroken = logged(tmp_path / "unbroken")
    assert [r["rollout/staleness_max"] for r in unbroken] == [0, 1, 0, 1]
    torn = run(tmp_path / "torn", fault="weight_sync:3")
    assert torn.returncode == -signal.SIGKILL, torn.stderr[-2000:]
    # /generate first: it waits for the bucket the server was still writing
    status, answer = _call(server, "/generate", {"prompts": [_prompts(task_env.tokenizer)[0]],
                                                 "sampling": _sampling(max_new_tokens=4)})  # fmt: skip
    assert status == 503 and "stopped half-way" in answer["detail"], answer
    health = _call(server, "/health")[1]
    assert health["torn_update"] == health["version"] + 1, health
    resumed = run(tmp_path / "torn", "run.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert _call(server, "/health")[1]["torn_update"] == 0
    again = logged(tmp_path / "torn")
    assert [r["step"] for r in again] == [1, 2, 3, 4]
    assert again == unbroken


def test_openai_completions_return_the_token_ids_and_log_probs_of_generate(server, task_env):
    tok = task_env.tokenizer
    prompt = _prompts(tok)[0]
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0.7, "seed": 5}
    status, answer = _call(server, "/v1/completions", body)
    assert status == 200 and answer["object"] == "text_completion"
    choice = answer["choices"][0]
    same = {"prompts": [prompt], "sampling": _sampling(max_new_tokens=8, seed=5)}
    generated = _call(server, "/generate", same)[1]
    assert choice["token_ids"] == generated["responses"][0]
    assert choice["logprobs"]["token_logprobs"] == generated["logprobs"][0]
    assert choice["prompt_token_ids"] == prompt and answer["policy_version"] == generated["version"]
    ended = choice["finish_reason"] == "stop"
    text_ids = choice["token_ids"][:-1] if ended else choice["token_ids"]
    assert choice["text"] == tok.decode(text_ids, skip_special_tokens=True)
    as_text = {**body, "prompt": tok.decode(prompt, skip_special_tokens=True)}
    assert _call(server, "/v1/completions", as_text)[1]["choices"][0]["prompt_token_ids"] == prompt
    assert _call(server, "/v1/completions", {**body, "n": 2})[0] == 400
    assert _call(server, "/v1/completions", {**body, "stop": ["x"]})[0] == 400
    assert _call(server, "/v1/completions", body, token="")[0] == 401


def test_openai_chat_completions_render_the_chat_template(server, task_env):
    messages = [{"role": "user", "content": "the food was"}]
    body = {"messages": messages, "max_completion_tokens": 6, "seed": 1}
    status, answer = _call(server, "/v1/chat/completions", body)
    assert status == 200 and answer["object"] == "chat.completion"
    choice = answer["choices"][0]
    ids = task_env.tokenizer(CHAT_TEMPLATE_TEXT.format("the food was"), add_special_tokens=False)
    assert choice["prompt_token_ids"] == ids["input_ids"]
    assert choice["message"]["role"] == "assistant"
    assert [c["logprob"] for c in choice["logprobs"]["content"]] == pytest.approx(
        _call(server, "/generate", {"prompts": [ids["input_ids"]],
                                    "sampling": _sampling(max_new_tokens=6, seed=1, temperature=1.0)})[1]["logprobs"][0]
    )  # fmt: skip
    assert _call(server, "/v1/chat/completions", {**body, "messages": []})[0] == 422
