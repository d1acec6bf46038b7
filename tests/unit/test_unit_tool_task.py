"""The tool-use task (rlhf_dist/demo/tool_task.py): its demonstrations render as the
multi-turn rollout renders its prompts, the call parses and runs, the reward is exact."""

from __future__ import annotations

import pytest

from rlhf_dist.demo import tool_task
from rlhf_dist.rollout.agent import Renderer, ToolEnvironment, tool_schema


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tool_task.build_tool_tokenizer(tmp_path_factory.mktemp("tool_tok"))


def test_a_demonstration_starts_with_the_rollouts_prompt_and_its_call_runs(tok):
    demo = tool_task.demonstration("old river", tool_task.TABLE["old river"], True)["messages"]
    renderer = Renderer(tok, tool_task.TEMPLATE, (tool_schema(tool_task.lookup),))
    prompt = renderer.render(demo[1:2], generation_prompt=True)
    full = tok.apply_chat_template(demo, tokenize=False, chat_template=tool_task.TEMPLATE)
    assert full.startswith(prompt)  # SFT's system turn = the template's tools turn
    ids = tok(full, add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids
    call = tok.decode(tok(demo[2]["content"], add_special_tokens=False)["input_ids"])
    env = ToolEnvironment({"lookup": tool_task.lookup}, 1.0)
    new, done, _ = env.step([*demo[:2], {"role": "assistant", "content": call}])
    assert new == [{"role": "tool", "content": tool_task.TABLE["old river"]}] and not done


def test_answer_reward_is_the_exact_answer():
    code = tool_task.TABLE["cold stone"]
    other = next(c for c in tool_task.CODES if c != code)
    prompts = [tool_task.QUESTION.format("cold stone")] * 3 + [[{"role": "user", "content": "hi"}]]
    responses = [f"the code is {code}", f"the code is {other}", f"code {code}", "the code is red"]
    assert tool_task.answer_reward(prompts, responses) == [1.0, 0.0, 0.0, 0.0]
    messages = [{"role": "user", "content": tool_task.QUESTION.format("cold stone")}]
    assert tool_task.answer_reward([messages], [f"the code is {code}"]) == [1.0]


def test_demonstrations_do_not_teach_the_table_and_rl_prompts_hold_keys_out(tmp_path):
    import json

    files = tool_task.write_tool_task(tmp_path, train_keys=96, tool_share=0.5)
    rows = [json.loads(line) for line in files["sft"].read_text().splitlines()]
    calls = [r for r in rows if len(r["messages"]) == 5]
    assert 0.3 < len(calls) / len(rows) < 0.7
    # The stand-in codes often differ from the tool's table: no answer to memorise.
    key = lambda r: tool_task.key_of(r["messages"][1]["content"])  # noqa: E731
    wrong = [r for r in rows if r["messages"][-1]["content"].split()[-1] != tool_task.TABLE[key(r)]]
    assert len(wrong) > len(rows) / 2
    read = lambda name: [json.loads(x)["prompt"] for x in files[name].read_text().splitlines()]  # noqa: E731
    rl, held_out = set(read("prompts")), set(read("eval_prompts"))
    assert len(rl) == 96 and len(held_out) == 32 and not rl & held_out
    # Every word of a held-out key was seen in the demonstrations (its embedding trained).
    sft = files["sft"].read_text()
    assert all(f" {w} " in sft for k in map(tool_task.key_of, held_out) for w in k.split())


def test_the_tool_demo_runs_with_grpo_only(tmp_path, capsys):
    from rlhf_dist.cli import main

    argv = ["demo", "--task", "tool_use", "--algorithm", "ppo", "--output-dir", str(tmp_path)]
    assert main(argv) == 2
    assert "--task tool_use: runs with --algorithm grpo only" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("task", "given", "runs"),
    [("reviews", None, "ppo"), ("reviews", "rloo", "rloo"), ("tool_use", None, "grpo")]
    + [("vision", None, "grpo"), ("arithmetic", None, "grpo"), ("vision", "dpo", "dpo")],
)
def test_a_demo_without_algorithm_runs_its_tasks_own_method(task, given, runs):
    import argparse

    from rlhf_dist.cli import demo_algorithm

    assert demo_algorithm(argparse.Namespace(task=task, algorithm=given)) == runs


@pytest.mark.parametrize("environment", ["function", "verifiers"])
def test_the_endpoint_demos_grpo_config_plays_through_the_server(tmp_path, environment):
    """demo --through-endpoint / --verifiers: the GRPO stage samples from the server and
    its environment drives the endpoint; with verifiers the prompts are the environment's
    dataset at the run's seed (write_tool_task's RL keys), and the config validates."""
    from rlhf_dist.config import config_from_dict, validate
    from rlhf_dist.demo import tool_demo

    if environment == "verifiers":
        pytest.importorskip("verifiers")
    files = {name: tmp_path / f"{name}.jsonl" for name in ("sft", "prompts", "eval_prompts")}
    trees = tool_demo.tool_stage_configs(tmp_path, files, tmp_path / "p", 3, False)
    tree = tool_demo.through_endpoint(trees["grpo"], "http://127.0.0.1:1", environment)
    g = tree["generation"]
    assert g["backend"] == "server" and g["environment_endpoint"] and "tools" not in g
    if environment == "verifiers":
        assert (
            tree["data"]["train"]
            == g["environment"]
            == f"{tool_demo.ENVIRONMENTS['verifiers']}?seed=3"
        )
    else:
        assert tree["data"]["train"] == str(files["prompts"])
    validate(config_from_dict(tree), "ppo")


def test_the_served_demos_grpo_config_keeps_the_tool_here_and_runs_k_steps_off(tmp_path):
    """demo --served: the GRPO stage's turns go to the server, the tool stays in the
    trainer's episodes, and ppo.max_staleness (refused without a server) validates."""
    from rlhf_dist.config import ConfigError, config_from_dict, validate
    from rlhf_dist.demo import tool_demo
    from rlhf_dist.demo.pipeline import with_overrides

    files = {name: tmp_path / f"{name}.jsonl" for name in ("sft", "prompts", "eval_prompts")}
    trees = tool_demo.tool_stage_configs(tmp_path, files, tmp_path / "p", 3, False)
    trees = with_overrides(trees, ["ppo.max_staleness=2"])
    with pytest.raises(ConfigError, match=r"^ppo.max_staleness: needs generation.backend=server"):
        tool_demo.validated_configs(trees, "")
    tree = tool_demo.grpo_with_server(trees["grpo"], "http://127.0.0.1:1", "served")
    g = tree["generation"]
    assert g["backend"] == "server" and g["tools"] == tool_demo.TOOLS
    assert not g.get("environment_endpoint")
    validate(config_from_dict(tree), "ppo")
    assert tool_demo.validated_configs(trees, "served")["grpo"].ppo.max_staleness == 2
