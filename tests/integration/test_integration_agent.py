"""Multi-turn tool-calling rollouts through the real rollout and PPO loop, on the tool-use
task (rlhf_dist/demo/tool_task.py) with a tiny Llama (docs/agents.md):

- a short SFT on demonstrations makes the policy call the tool;
- the rollout's scoring attends to the tool's tokens but gives them no log-prob, KL or
  entropy (response_mask), and its log-probs are those of the exact sampled sequence;
- a GRPO run with the tool trains the actor and logs the multi-turn metrics;
- killed half-way through an iteration and resumed, it logs bitwise the metrics and
  exports bitwise the weights of the unbroken run;
- under LoRA it trains the adapters only, its reference is the adapters-off base, and its
  first rollout (adapters at zero) is bitwise the rollout without LoRA.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from faults import Killed, kill_at, untimed

from rlhf_dist.algo.objectives import tied_groups
from rlhf_dist.config import config_from_dict
from rlhf_dist.demo import tool_task
from rlhf_dist.engine.forward import token_logprobs
from rlhf_dist.errors import UserError
from rlhf_dist.rollout.agent import TOOL_CALL, tool_schema
from rlhf_dist.trainers.ppo import recipe as ppo
from rlhf_dist.trainers.ppo import rollout as ppo_rollout
from rlhf_dist.trainers.ppo import setup as ppo_setup
from rlhf_dist.trainers.ppo import update as ppo_update

TOOLS = ["rlhf_dist.demo.tool_task:lookup"]
REWARD = "rlhf_dist.demo.tool_task:answer_reward"
DATA = {"max_prompt_length": 32, "max_length": 64}


@pytest.fixture(scope="module")
def tool_sft(runtime, tmp_path_factory):
    """(task files, SFT'd policy dir): 12 epochs of 64 demonstrations (a few seconds)."""
    from rlhf_dist.demo.task import build_tiny_models
    from rlhf_dist.trainers.sft import train_sft

    root = tmp_path_factory.mktemp("tool_task")
    files = tool_task.write_tool_task(root / "data")
    tokenizer = tool_task.build_tool_tokenizer(root / "tokenizer")
    policy = build_tiny_models(root / "models", tokenizer, size="tiny", seed=0)["policy"]
    cfg = config_from_dict(
        {
            "run": {"output_dir": str(root / "sft"), "seed": 0, "log_every": 50},
            "model": {"policy": str(policy)},
            "data": {**DATA, "train": str(files["sft"])},
            "sft": {
                "epochs": 12,
                "batch_size": 16,
                "micro_batch_size": 16,
                "optim": {"lr": 3e-3, "schedule": "cosine", "warmup_steps": 5},
            },
        }
    )
    train_sft(cfg, runtime)
    return files, root / "sft" / "final"


def grpo_tree(out, policy, files, checkpoint_every: int = 0, **generation) -> dict:
    return {
        "run": {
            "output_dir": str(out),
            "seed": 1,  # seed 0's first rollout ties every group (no GRPO gradient)
            "log_every": 1,
            "checkpoint_every": checkpoint_every,
        },
        "model": {"policy": str(policy)},
        "data": {**DATA, "train": str(files["prompts"])},
        "generation": {
            "max_new_tokens": 16,
            "temperature": 1.0,
            "tools": TOOLS,
            "max_turns": 3,
            **generation,
        },
        "reward": {"function": REWARD},
        "ppo": {
            "iterations": 2,
            "rollout_batch_size": 4,
            "samples_per_prompt": 4,
            "rollout_micro_batch_size": 16,
            "ppo_epochs": 1,
            "minibatch_size": 8,
            "micro_batch_size": 8,
            "optim": {"lr": 1e-3},
            "kl_coef": 0.05,
            "estimator": "grpo",
        },
    }


def record_rollouts(mp) -> list:
    """(batch, texts, RolloutModels) of every rollout PPO collects while `mp` is active."""
    rollouts, original = [], ppo_rollout.collect_rollout

    def spy(*args, **kwargs):
        batch, texts = original(*args, **kwargs)
        rollouts.append((batch, texts, args[0]))
        return batch, texts

    mp.setattr(ppo_rollout, "collect_rollout", spy)
    return rollouts


@pytest.fixture(scope="module")
def tool_grpo(tool_sft, runtime, tmp_path_factory):
    """(output dir, the rollouts) of one unbroken 2-iteration GRPO run with the tool, two
    optimizer steps per iteration, a checkpoint after each iteration."""
    files, policy = tool_sft
    out = tmp_path_factory.mktemp("tool_grpo") / "run"
    with pytest.MonkeyPatch.context() as mp:
        rollouts = record_rollouts(mp)
        ppo.train_ppo(config_from_dict(grpo_tree(out, policy, files, checkpoint_every=1)), runtime)
    return out, rollouts


def test_rollout_scores_the_sampled_sequence_and_masks_tool_tokens(tool_grpo):
    (batch, texts, models), _ = tool_grpo[1]
    tool_tokens = batch.response_attention.bool() & ~batch.response_mask
    assert tool_tokens.any(), "the SFT policy called no tool"
    assert batch.tool_calls.sum() > 0 and (batch.turns >= 2).any()
    # Context tokens get nothing: log-probs and the reference's 0 there.
    assert (batch.ref_logprobs[tool_tokens] == 0).all()
    assert (batch.old_logprobs[tool_tokens] == 0).all()
    # The reference (the SFT policy, frozen) scored exactly the sampled ids with the tool
    # tokens attended: recomputing on the batch's own tensors gives the same log-probs, and
    # hiding the tool tokens from attention changes them.
    again, _ = token_logprobs(
        models.reference, batch.input_ids, batch.attention_mask, batch.response_mask, 1.0
    )
    assert torch.allclose(again, batch.ref_logprobs, atol=1e-5)
    blind = torch.cat([batch.prompt_mask, batch.response_mask.long()], dim=1)
    hidden, _ = token_logprobs(models.reference, batch.input_ids, blind, batch.response_mask, 1.0)
    assert not torch.allclose(hidden, batch.ref_logprobs, atol=1e-3)
    # Texts handed to the reward are the final turns: an episode the environment ended
    # (finished) ends with a turn that calls no tool.
    done = [
        t for t, f, n in zip(texts, batch.finished.tolist(), batch.turns.tolist()) if f and n > 1
    ]
    assert done and not any(TOOL_CALL.search(t) for t in done)


@pytest.mark.slow
def test_grpo_with_a_tool_trains_the_actor_and_logs_multi_turn_metrics(
    tool_sft, tool_grpo, saved_state_dict, changed_tensors, read_jsonl
):
    (_, policy), (out, _) = tool_sft, tool_grpo
    assert changed_tensors(saved_state_dict(policy), saved_state_dict(out / "final"))
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 1.0 <= r["rollout/turns"] <= 3.0
        assert r["rollout/tool_calls"] > 0
        assert 0.0 <= r["rollout/tool_errors"] <= r["rollout/tool_calls"]
        assert 0.0 <= r["rollout/truncated_episodes"] <= 1.0


@pytest.mark.slow
def test_a_multi_turn_run_killed_mid_iteration_resumes_bitwise(
    tool_sft, tool_grpo, runtime, tmp_path, monkeypatch, saved_state_dict, read_jsonl
):
    """Killed after the first of iteration 2's two optimizer steps (its episodes played,
    tools called, weights half-updated), resumed from iteration 1's checkpoint: the
    episodes, tool calls, metrics (bitwise, every float) and final weights are the
    unbroken run's. A kill leaves the process, so nothing of it may carry over: every
    piece of state the episode loop reads must come from the checkpoint."""
    files, policy = tool_sft
    unbroken, rollouts = tool_grpo
    out = tmp_path / "run"
    tree = grpo_tree(out, policy, files, checkpoint_every=1)

    with monkeypatch.context() as mp:
        kill_at(mp, ppo_update, "update", 2)
        with pytest.raises(Killed):
            ppo.train_ppo(config_from_dict(tree), runtime)
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-000001"
    assert not (out / "final").exists()
    tree["run"]["resume"] = "auto"
    resumed = record_rollouts(monkeypatch)
    ppo.train_ppo(config_from_dict(tree), runtime)
    ((again, texts, _),) = resumed  # iteration 2 only
    batch, unbroken_texts, _ = rollouts[1]
    assert torch.equal(again.response_ids, batch.response_ids) and texts == unbroken_texts
    assert torch.equal(again.tool_calls, batch.tool_calls)
    assert untimed(read_jsonl(out / "metrics.jsonl")) == untimed(
        read_jsonl(unbroken / "metrics.jsonl")
    )
    want, got = saved_state_dict(unbroken / "final"), saved_state_dict(out / "final")
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.slow
def test_grpo_with_a_tool_under_lora_trains_adapters_against_the_adapters_off_base(
    tool_sft, tool_grpo, runtime, tmp_path, monkeypatch, saved_state_dict, read_jsonl
):
    """LoRA changes nothing of the episode: the first rollout (adapters at zero) is the
    full model's: the same ids, masks and tool tokens (the adapters add exactly 0, and
    generation runs on base weights merged with that 0), log-probs to fp32 rounding (peft's
    wrapper computes them on another path). Then the adapters
    train, the base stays the SFT policy's, and the reference of the second rollout is
    that base (adapters off), not the adapted actor; tool tokens get no log-prob."""
    from rlhf_dist.models.lora import AdapterOffReference

    files, policy = tool_sft
    out = tmp_path / "lora"
    tree = grpo_tree(out, policy, files)
    tree["lora"] = {"enabled": True, "r": 4}
    built = []
    original = ppo_setup.build_models
    monkeypatch.setattr(
        ppo_setup, "build_models", lambda *a: built.append(original(*a)) or built[-1]
    )
    rollouts = record_rollouts(monkeypatch)
    ppo.train_ppo(config_from_dict(tree), runtime)
    (first, first_texts, models), (second, _, _) = rollouts
    plain, plain_texts, plain_models = tool_grpo[1][0]
    assert isinstance(models.reference, AdapterOffReference)
    for name in ("response_ids", "response_mask", "response_attention", "turns", "tool_calls"):
        assert torch.equal(getattr(first, name), getattr(plain, name)), name
    assert first_texts == plain_texts
    torch.testing.assert_close(first.ref_logprobs, plain.ref_logprobs, rtol=1e-5, atol=1e-6)
    # adapters start at zero
    torch.testing.assert_close(first.old_logprobs, first.ref_logprobs, rtol=1e-5, atol=1e-6)
    # The second rollout: the reference is still the SFT policy; the actor moved.
    tool_tokens = second.response_attention.bool() & ~second.response_mask
    assert tool_tokens.any()
    sft, _ = token_logprobs(
        plain_models.reference,
        second.input_ids,
        second.attention_mask,
        second.response_mask,
        1.0,
    )
    assert torch.allclose(second.ref_logprobs, sft, atol=1e-5)
    sampled = second.response_mask
    # GRPO trains nothing on a rollout whose groups all tie (exact-answer rewards of 4
    # samples often do): the run's seed gives iteration 1 some spread.
    assert not tied_groups(first.scores, 4).all(), "every group tied: nothing trained"
    assert not torch.allclose(second.old_logprobs[sampled], second.ref_logprobs[sampled])
    for x in (second.old_logprobs, second.ref_logprobs, second.entropy):
        assert (x[tool_tokens] == 0).all()
    # Only the adapters trained; the base weights are the SFT policy's.
    net = runtime.unwrap(built[0].model)
    trained = {n: p for n, p in net.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    assert any(p.abs().sum() > 0 for n, p in trained.items() if "lora_B" in n)
    base = {
        n.replace("base_model.model.", "").replace("base_layer.", ""): p
        for n, p in net.actor.state_dict().items()
        if "lora_" not in n
    }
    for name, tensor in saved_state_dict(policy).items():
        assert torch.equal(base[name], tensor), name
    rows = read_jsonl(out / "metrics.jsonl")
    assert rows[0]["objective/kl"] == 0.0 and rows[1]["objective/kl"] != 0.0
    assert rows[0]["rollout/tool_calls"] > 0


@pytest.mark.slow
def test_grpo_with_a_tool_on_the_vllm_backend(tool_sft, runtime, tmp_path, read_jsonl):
    """The engine samples every turn; its log-probs of the sampled tokens agree with the
    trainer's (the tool's tokens carry none: masked like the losses)."""
    pytest.importorskip("vllm")
    files, policy = tool_sft
    out = tmp_path / "grpo_vllm"
    tree = grpo_tree(out, policy, files, backend="vllm", vllm_kv_cache_gib=0.25)
    tree["ppo"]["iterations"] = 1
    ppo.train_ppo(config_from_dict(tree), runtime)
    (row,) = read_jsonl(out / "metrics.jsonl")
    assert row["rollout/tool_calls"] > 0 and row["rollout/turns"] > 1.0
    assert row["rollout/sampler_logprob_absdiff"] < 0.05


@pytest.mark.slow  # a server process starts (~10-20 s on 2 cores)
def test_grpo_with_a_tool_on_a_rollout_server(
    tool_sft, runtime, tmp_path, read_jsonl, saved_state_dict, monkeypatch
):
    """Every turn sampled by `rlhf-dist serve` (generation.backend=server): the weights are
    synced once per rollout, the episodes call the tool, the served log-probs are the
    trainer's own (the hf server scores with the trainer's forward), and the actor trains.
    With ppo.max_staleness = k (1, then 2: deferred syncs) the tool episodes of the next k
    iterations play in this process on the prefetch worker while the trainer trains, by
    the servers holding the weights iteration max(c + 1, i - k) started with (c the last
    checkpoint): the staleness and versions logged are exactly those, every turn came back
    with that version (else ServerError), the sampler's log-probs are the trainer's
    on-policy and not after an update, and the actor trains. At k = 1, killed in
    iteration 3 with iteration 4's episodes playing and resumed from iteration 2's
    checkpoint, the run logs the unbroken run's metrics (the servers' version aside): the
    turns' seeds come from the checkpointed RNG, whichever thread plays them."""
    from serve_process import served

    files, policy = tool_sft
    token, env = "tool-server-token-3f9a", "RLHF_DIST_TEST_TOOL_SERVER_TOKEN"
    monkeypatch.setenv(env, token)
    tree = {"model": {"policy": str(policy)}, "perf": {"num_threads": 1},
            "distributed": {"timeout_s": 60}}  # fmt: skip

    def run(name: str, k: int = 0, iterations: int = 2, **keys) -> list[dict]:
        out = tmp_path / name
        run = grpo_tree(out, policy, files, backend="server", server_urls=[url],
                        server_token_env=env)  # fmt: skip
        run["ppo"] |= {"iterations": iterations, "max_staleness": k}
        run["run"] |= keys
        ppo.train_ppo(config_from_dict(run), runtime)
        rows = read_jsonl(out / "metrics.jsonl")
        assert all(r["rollout/turns"] > 1.0 for r in rows) and rows[0]["rollout/tool_calls"] > 0
        before, after = saved_state_dict(policy), saved_state_dict(out / "final")
        assert any(not torch.equal(before[k], after[k]) for k in before)
        return rows

    with served(tree, env, token) as url:
        rows = run("grpo_server")
        assert [r["rollout/policy_version"] for r in rows] == [1, 2]  # one sync per rollout
        assert all(r["rollout/sampler_logprob_absdiff"] < 1e-4 for r in rows)
        k1 = {"checkpoint_every": 2}  # nothing requested across iteration 2's checkpoint
        for k, keys, staleness, moved in ((1, k1, [0, 1, 0, 1], [0, 0, 2, 2]),
                                          (2, {}, [0, 1, 2, 2], [0, 0, 0, 1])):  # fmt: skip
            rows = run(f"k{k}", k, 4, **keys)
            assert [r["rollout/staleness_max"] for r in rows] == staleness
            v = rows[0]["rollout/policy_version"]
            assert [r["rollout/policy_version"] - v for r in rows] == moved
            gaps = [r["rollout/sampler_logprob_absdiff"] for r in rows]
            assert [g > 1e-4 for g in gaps] == [s > 0 for s in staleness]  # stale: a gap
            if k == 1:
                unbroken = rows
        with pytest.MonkeyPatch.context() as m:
            rollouts = record_rollouts(m)
            kill_at(m, ppo, "rollout", 3)
            with pytest.raises(Killed):
                run("k1_killed", 1, 4, **k1)
        # SIGKILL ends the killed trainer's worker with it: here its queued work is cancelled
        rollouts[-1][2].sampler.pool.shutdown(wait=True, cancel_futures=True)
        resumed = run("k1_killed", 1, 4, resume="auto", **k1)
        for row in (*resumed, *unbroken):
            del row["rollout/policy_version"]
        assert untimed(resumed) == untimed(unbroken)


def openai_episode(client, prompt):
    """The tool task driven by the official `openai` client, as environment libraries do
    (generation.environment_endpoint): a chat call, a lookup when the reply calls it
    (OpenAI tool_calls), a second call."""
    import openai

    api = openai.OpenAI(base_url=client.base_url, api_key=client.api_key)
    messages = [{"role": "user", "content": prompt}]
    for _ in range(2):
        reply = api.chat.completions.create(
            model=client.model, messages=messages, tools=[tool_schema(tool_task.lookup)],
            **client.openai_fields,
        )  # fmt: skip
        said = reply.choices[0].message
        messages.append(said.model_dump(exclude_none=True))
        if not said.tool_calls:
            return None
        [call] = said.tool_calls
        result = tool_task.lookup(**json.loads(call.function.arguments))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None


def one_step_off_resumes(tmp_path, url, env, files, policy, runtime, environment):
    """ppo.max_staleness=1 through the endpoint: iteration k+1's episodes play on the
    servers while iteration k trains, by the weights k started with (none across the
    checkpoint of iteration 2); killed in iteration 3 with iteration 4's episodes in
    flight and resumed, the run logs what the unbroken one logs (the servers' version
    counter aside): the episodes are named from the checkpointed RNG."""
    from rlhf_dist.trainers.ppo import recipe as ppo_module

    def run(name: str, **keys):
        tree = grpo_tree(tmp_path / name, policy, files, checkpoint_every=2, backend="server",
                         server_urls=[url], server_token_env=env, environment=environment,
                         environment_endpoint=True)  # fmt: skip
        del tree["generation"]["tools"]
        tree["ppo"] |= {"iterations": 4, "max_staleness": 1}
        tree["run"] |= keys
        ppo_module.train_ppo(config_from_dict(tree), runtime)
        return _read(tmp_path / name / "metrics.jsonl")

    unbroken = run("unbroken")
    assert [r["rollout/staleness_max"] for r in unbroken] == [0, 1, 0, 1]
    v = unbroken[0]["rollout/policy_version"]
    assert [r["rollout/policy_version"] for r in unbroken] == [v, v, v + 2, v + 2]
    assert all(r["rollout/turns"] > 1.0 and r["time/generate_request"] > 0 for r in unbroken)
    gaps = [r["rollout/sampler_logprob_absdiff"] for r in unbroken]
    assert gaps[0] < 1e-4 and gaps[2] < 1e-4  # on-policy
    assert gaps[1] > 1e-4 and gaps[3] > 1e-4  # one update old
    with pytest.MonkeyPatch.context() as m:
        kill_at(m, ppo_module, "rollout", 3)
        with pytest.raises(Killed):
            run("killed")
    resumed, unbroken = untimed(run("killed", resume="auto")), untimed(unbroken)
    for row in (*resumed, *unbroken):
        del row["rollout/policy_version"]
    assert resumed == unbroken


def _read(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow  # a server process starts (~10-20 s on 2 cores)
def test_grpo_with_an_environment_that_drives_the_policy_through_the_endpoint(
    tool_sft, runtime, tmp_path, read_jsonl, saved_state_dict, monkeypatch
):
    """generation.environment_endpoint: the environment only speaks OpenAI chat to the
    server; the trainer trains on the ids the server recorded. The served log-probs are
    the trainer's own forward over exactly those ids (a re-tokenised conversation would
    show a gap), tools are called, versions move once per rollout, the actor trains; the
    official openai client drives it the same way, and so does the task written as a
    verifiers ToolEnv (its prompts from the environment's dataset, the tool calls read
    from the server's OpenAI `tool_calls` and run by verifiers, the reward its rubric's,
    with no reward.function set). With no reward source, an episode that returns no reward
    stops the run. One step off-policy, the next iteration's episodes play while one
    trains."""
    pytest.importorskip("openai")
    from serve_process import served

    files, policy = tool_sft
    token, env = "endpoint-env-token-8e21", "RLHF_DIST_TEST_ENDPOINT_TOKEN"
    monkeypatch.setenv(env, token)
    tree = {"model": {"policy": str(policy)}, "perf": {"num_threads": 1},
            "distributed": {"timeout_s": 60}}  # fmt: skip
    runs = [
        ("demo", "rlhf_dist.demo.tool_task:endpoint_episode", 2),
        ("openai", "test_integration_agent:openai_episode", 1),
    ]
    if importlib.util.find_spec("verifiers") is not None:  # launch/setup.sh installs it
        runs.append(("verifiers", "verifiers:rlhf_dist.demo.tool_verifiers", 1))
    with served(tree, env, token) as url:
        for name, fn, iterations in runs:
            out = tmp_path / name
            run = grpo_tree(out, policy, files, backend="server", server_urls=[url],
                            server_token_env=env, environment=fn,
                            environment_endpoint=True)  # fmt: skip
            del run["generation"]["tools"]
            run["ppo"]["iterations"] = iterations
            if name == "verifiers":  # its dataset (files["prompts"]' keys); its rubric alone
                run["data"]["train"] = fn
                del run["reward"]
            ppo.train_ppo(config_from_dict(run), runtime)
            rows = read_jsonl(out / "metrics.jsonl")
            assert len(rows) == iterations
            assert all(r["rollout/turns"] > 1.0 and r["rollout/tool_calls"] > 0 for r in rows)
            assert all(r["rollout/sampler_logprob_absdiff"] < 1e-4 for r in rows)
            before, after = saved_state_dict(policy), saved_state_dict(out / "final")
            assert any(not torch.equal(before[k], after[k]) for k in before)
        one_step_off_resumes(tmp_path, url, env, files, policy, runtime, runs[0][1])
        # an environment that returns no reward is a reward source only if it scores:
        # with no other source, its first unscored episode stops the run in one line
        run = grpo_tree(tmp_path / "unscored", policy, files, backend="server",
                        server_urls=[url], server_token_env=env, environment=runs[1][1],
                        environment_endpoint=True)  # fmt: skip
        del run["generation"]["tools"], run["reward"]
        with pytest.raises(UserError, match=r"^generation\.environment: episode 0 returned no"):
            ppo.train_ppo(config_from_dict(run), runtime)
