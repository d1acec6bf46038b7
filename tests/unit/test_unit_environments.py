"""verifiers environments (`verifiers:ENV_ID?...`; config/environments.py,
data/environments.py, rollout/environments.py): the spec, its validation, the rows of an
environment's datasets and the episode function over one. The episode against a real
rollout server: tests/integration/test_integration_agent.py."""

from __future__ import annotations

import sys
import types

import pytest

from rlhf_dist.config import ConfigError, config_from_dict, validate
from rlhf_dist.config import validation as validation_mod
from rlhf_dist.config.environments import parse_environment_spec
from rlhf_dist.data import environments as data_env

DEMO = "verifiers:rlhf_dist.demo.tool_verifiers"


def test_a_spec_names_the_environment_and_its_arguments():
    spec = parse_environment_spec("verifiers:my-env?max_turns=3&name=x&strict=true", "k")
    assert spec.env_id == "my-env"
    assert spec.args == (("max_turns", 3), ("name", "x"), ("strict", True))
    assert parse_environment_spec("verifiers:org/my_env", "k").args == ()
    for bad in ("verifiers:", "verifiers:a b", "verifiers:x?k", "verifiers:x?k=1&k=2"):
        with pytest.raises(ConfigError, match=r"^data\.train: "):
            parse_environment_spec(bad, "data.train")


def endpoint_tree(environment: str, endpoint: bool = True, train: str = "p.jsonl") -> dict:
    return {
        "model": {"policy": "p"},
        "data": {"train": train},
        "reward": {"function": "rlhf_dist.demo.tool_task:answer_reward"},
        "generation": {
            "environment": environment,
            "environment_endpoint": endpoint,
            "backend": "server",
            "server_urls": ["http://127.0.0.1:1"],
        },  # fmt: skip
        "ppo": {
            "estimator": "grpo",
            "samples_per_prompt": 2,
            "rollout_batch_size": 2,
            "minibatch_size": 4,
            "micro_batch_size": 4,
        },  # fmt: skip
    }


def test_validation_wants_the_endpoint_and_the_package(monkeypatch):
    """A verifiers environment drives an OpenAI client: it plays through the endpoint
    only; an environment is a reward source (its rubric, a function's returned rewards:
    no reward.function needed), tools alone are not; without the package every spec is
    one line naming its key."""
    pytest.importorskip("verifiers")
    with pytest.raises(ConfigError, match="generation.environment: a verifiers environment"):
        validate(config_from_dict(endpoint_tree(DEMO, endpoint=False)), "ppo")
    rubric_only = endpoint_tree(DEMO)
    del rubric_only["reward"]
    validate(config_from_dict(rubric_only), "ppo")
    validate(config_from_dict({**endpoint_tree("m:f"), "reward": {}}), "ppo")
    tools_only = {**endpoint_tree("m:f", endpoint=False), "reward": {}}
    tools_only["generation"] = {"tools": ["m:lookup"]}
    with pytest.raises(ConfigError, match="^model.reward: required"):
        validate(config_from_dict(tools_only), "ppo")
    monkeypatch.setattr(validation_mod, "_installed", lambda module: module != "verifiers")
    for tree, key in ((endpoint_tree(DEMO), "generation.environment"),
                      (endpoint_tree("m:f", train=DEMO), "data.train")):  # fmt: skip
        with pytest.raises(ConfigError, match=rf"^{key}: .* needs the verifiers package"):
            validate(config_from_dict(tree), "ppo")


@pytest.fixture
def fake_env_module(monkeypatch):
    """An importable environment module whose environment has a training dataset with
    Arrow's None-filled message fields, and no evaluation dataset."""
    pytest.importorskip("verifiers")
    rows = [{"prompt": [{"role": "user", "content": "q", "tool_calls": None}], "answer": "a"}]
    env = types.SimpleNamespace(
        build_dataset=lambda: rows, build_eval_dataset=lambda: None, env_id=None, env_args=None
    )
    module = types.ModuleType("fake_vf_env")
    module.load_environment = lambda: env  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_vf_env", module)
    monkeypatch.setattr(data_env, "_ENVIRONMENTS", {})
    return "verifiers:fake_vf_env"


def test_rows_come_from_the_environments_datasets_never_train_for_eval(fake_env_module):
    [row] = data_env.environment_rows(fake_env_module, "data.train", "train")
    assert row == {"prompt": [{"role": "user", "content": "q"}], "answer": "a"}
    with pytest.raises(ConfigError, match="^data.eval: .* has no evaluation dataset"):
        data_env.environment_rows(fake_env_module, "data.eval", "eval")
    with pytest.raises(ConfigError, match="^data.train: verifiers could not load 'nope_env'"):
        data_env.environment("verifiers:nope_env", "data.train")


def test_the_tool_task_environment_splits_as_the_demo_files(tmp_path):
    """demo/tool_verifiers.py: its datasets are write_tool_task's RL and held-out keys."""
    pytest.importorskip("verifiers")
    import json

    from rlhf_dist.demo import tool_task

    files = tool_task.write_tool_task(tmp_path, seed=3)
    rows = data_env.environment_rows(f"{DEMO}?seed=3", "data.train", "train")
    held_out = data_env.environment_rows(f"{DEMO}?seed=3", "data.eval", "eval")
    prompts = [json.loads(line)["prompt"] for line in files["prompts"].read_text().splitlines()]
    assert [r["prompt"] for r in rows] == [[{"role": "user", "content": p}] for p in prompts]
    assert all(r["answer"] == tool_task.TABLE[tool_task.key_of(r["prompt"])] for r in rows)
    assert len(held_out) == 32 and not {r["question"] for r in held_out} & set(prompts)


class StandIn:
    """A verifiers environment's run_rollout, recorded, answering `output`."""

    def __init__(self, output: dict):
        self.output, self.calls = output, []

    async def run_rollout(self, row, client, model, sampling_args):
        self.calls.append((row, client, model, sampling_args))
        return self.output


def test_an_episode_runs_one_verifiers_rollout_and_returns_its_reward():
    """The row as verifiers passes a dataset row (the prompt as messages), the episode's
    model name and the run's sampling fields; the rubric's reward comes back. A rollout
    verifiers ended for the policy's empty answer keeps its reward; one it ended for a
    failed request stops with the error chain."""
    vf = pytest.importorskip("verifiers")
    from rlhf_dist.rollout.endpoint import EndpointClient
    from rlhf_dist.rollout.environments import VerifiersEpisode

    client = EndpointClient("http://127.0.0.1:1/v1", "tok", "policy#0-1-2", {"top_k": 5})
    env = StandIn({"reward": 0.75, "error": None})
    assert VerifiersEpisode(env)(client, "q?", answer="a", example_id=4) == 0.75
    [(row, vf_client, model, sampling)] = env.calls
    assert row == {"example_id": 4, "answer": "a", "prompt": [{"role": "user", "content": "q?"}]}
    assert isinstance(vf_client, vf.OpenAIChatCompletionsClient) and model == "policy#0-1-2"
    assert sampling == {"extra_body": {"top_k": 5}}
    empty = {"error": "EmptyModelResponseError", "message": "no content"}
    assert VerifiersEpisode(StandIn({"reward": 0.0, "error": empty}))(client, "q?") == 0.0
    failed = {"reward": 0.0, "error": {"error": "ModelError"}, "error_chain": "ModelError('401')"}
    with pytest.raises(RuntimeError, match=r"rollout failed: ModelError\('401'\)"):
        VerifiersEpisode(StandIn(failed))(client, "q?")
