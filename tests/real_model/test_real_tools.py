"""Tools on the real chat model as it ships (docs/agents.md, "Tools and the chat template").

SmolLM2's own chat template ignores `tools`: served with it, a chat request that carries
tools is refused with a 400 naming data.chat_template, and a run whose environment sends
one stops with that line. Served with data.chat_template: chatml_tools, the real weights
play two-turn episodes through the OpenAI endpoint (the second turn rendered after the
ids sampled in the first, never re-tokenised; concurrent turns sampled as one batch), the
trainer's log-probs over the recorded ids match the server's, and GRPO trains on them.
"""

from __future__ import annotations

import json

import pytest
import torch
from serve_process import served
from transformers import AutoModelForCausalLM

import rlhf_dist
from rlhf_dist.errors import UserError

LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "The code of a key in the table.",
        "parameters": {
            "type": "object",
            "properties": {"key": {"type": "string", "description": "the key"}},
            "required": ["key"],
        },
    },
}


def two_turns(client, prompt) -> float:
    """An environment of two turns, whatever the first one says (so the continuation is
    played on any CPU's samples): a tool result when the reply called lookup, else a
    user's nudge; the reward prefers short final answers (GRPO gets a gradient)."""
    messages = list(prompt)  # the row's conversation
    reply = client.chat(messages, tools=[LOOKUP])["choices"][0]["message"]
    messages.append(reply)
    if reply.get("tool_calls"):
        call = reply["tool_calls"][0]
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": "7"})
    else:
        messages.append({"role": "user", "content": "Please answer in one word."})
    final = client.chat(messages, tools=[LOOKUP])["choices"][0]["message"]
    return -len(final.get("content") or "") / 100.0


def run_tree(out, policy, prompts, url, env) -> dict:
    return {
        "run": {"output_dir": str(out), "seed": 0, "log_every": 1, "progress": False},
        "model": {"policy": str(policy)},
        "data": {"train": str(prompts), "max_prompt_length": 96, "max_length": 160},
        "generation": {
            "backend": "server",
            "server_urls": [url],
            "server_token_env": env,
            "environment": "test_real_tools:two_turns",
            "environment_endpoint": True,
            "max_new_tokens": 16,
            "temperature": 1.0,
            "max_turns": 2,
        },  # fmt: skip
        "ppo": {
            "estimator": "grpo",
            "iterations": 1,
            "rollout_batch_size": 2,
            "samples_per_prompt": 2,
            "rollout_micro_batch_size": 4,
            "minibatch_size": 4,
            "micro_batch_size": 4,
            "ppo_epochs": 1,
            "optim": {"lr": 1e-4},
        },  # fmt: skip
        "distributed": {"timeout_s": 120},
    }


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("tool_prompts") / "prompts.jsonl"
    rows = ['{"prompt": [{"role": "user", "content": "What is the code of the key river?"}]}']
    path.write_text("\n".join(rows * 2) + "\n")
    return path


def serve_tree(policy, template: str = "") -> dict:
    return {
        "model": {"policy": str(policy)},
        "data": {"chat_template": template},
        "perf": {"num_threads": 1},
        "distributed": {"timeout_s": 120},
        # the episodes' concurrent turns sampled as one batch (serving/batching.py)
        "serve": {"batch_window_ms": 50},
    }


def weights(path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(str(path)).state_dict()


@pytest.mark.slow  # two server processes start (~15 s each on 2 cores), one on the real weights
def test_real_template_refuses_tools_and_chatml_tools_plays_two_turn_episodes(
    smollm2, tiny_real_vocab, prompts, tmp_path, monkeypatch
):
    token, env = "real-tools-token-51c7", "RLHF_DIST_TEST_REAL_TOOLS_TOKEN"
    monkeypatch.setenv(env, token)
    # The shipped template, on a tiny model with the real tokenizer (fast to load): refused.
    stand_in = tiny_real_vocab["shipped"]["policy"]
    with served(serve_tree(stand_in), env, token) as url:
        run = run_tree(tmp_path / "hidden", stand_in, prompts, url, env)
        with pytest.raises(UserError, match=r"HTTP 400 .*does not show tools.*chatml_tools"):
            rlhf_dist.ppo(run)
    # The real weights with chatml_tools: two turns each, token in, token out.
    policy = smollm2["shipped"]
    with served(serve_tree(policy, "chatml_tools"), env, token) as url:
        run = run_tree(tmp_path / "grpo", policy, prompts, url, env)
        run["data"]["chat_template"] = "chatml_tools"
        rlhf_dist.ppo(run)
    lines = (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()
    [row] = [json.loads(line) for line in lines if line.strip()]
    assert row["rollout/turns"] == 2.0
    assert row["rollout/sampler_logprob_absdiff"] < 1e-4  # the recorded ids, re-scored
    before, after = weights(policy), weights(tmp_path / "grpo" / "final")
    assert any(not torch.equal(before[k], after[k]) for k in before)
