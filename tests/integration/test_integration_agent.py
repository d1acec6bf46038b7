"""Multi-turn tool-calling rollouts through the real rollout and PPO loop, on the tool-use
task (rlhf_dist/demo/tool_task.py) with a tiny Llama (docs/agents.md):

- a short SFT on demonstrations makes the policy call the tool;
- the rollout's scoring attends to the tool's tokens but gives them no log-prob, KL or
  entropy (response_mask), and its log-probs are those of the exact sampled sequence;
- a GRPO run with the tool trains the actor and logs the multi-turn metrics.
"""

from __future__ import annotations

import pytest
import torch

from rlhf_dist.agent import TOOL_CALL
from rlhf_dist.config import config_from_dict
from rlhf_dist.demo import tool_task
from rlhf_dist.models import token_logprobs
from rlhf_dist.trainers import ppo

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


def grpo_tree(out, policy, files, **generation) -> dict:
    return {
        "run": {"output_dir": str(out), "seed": 0, "log_every": 1},
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
            "minibatch_size": 16,
            "micro_batch_size": 8,
            "actor": {"lr": 1e-3},
            "kl_coef": 0.05,
            "estimator": "grpo",
        },
    }


def test_rollout_scores_the_sampled_sequence_and_masks_tool_tokens(
    tool_sft, runtime, tmp_path, monkeypatch
):
    files, policy = tool_sft
    rollouts = []
    original = ppo.collect_rollout

    def spy(*args, **kwargs):
        batch, texts = original(*args, **kwargs)
        rollouts.append((batch, texts, args[0]))
        return batch, texts

    monkeypatch.setattr(ppo, "collect_rollout", spy)
    tree = grpo_tree(tmp_path / "grpo", policy, files)
    tree["ppo"]["iterations"] = 1
    ppo.train_ppo(config_from_dict(tree), runtime)
    ((batch, texts, models),) = rollouts
    tool_tokens = batch.response_attention.bool() & ~batch.response_mask
    assert tool_tokens.any(), "the SFT policy called no tool"
    assert batch.tool_calls.sum() > 0 and (batch.turns >= 2).any()
    # Context tokens get nothing: log-probs and the reference's 0 there.
    assert (batch.ref_logprobs[tool_tokens] == 0).all()
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
    tool_sft, runtime, tmp_path, saved_state_dict, changed_tensors, read_jsonl
):
    files, policy = tool_sft
    out = tmp_path / "grpo"
    ppo.train_ppo(config_from_dict(grpo_tree(out, policy, files)), runtime)
    assert changed_tensors(saved_state_dict(policy), saved_state_dict(out / "final"))
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 1.0 <= r["rollout/turns"] <= 3.0
        assert r["rollout/tool_calls"] > 0
        assert 0.0 <= r["rollout/tool_errors"] <= r["rollout/tool_calls"]
        assert 0.0 <= r["rollout/truncated_episodes"] <= 1.0


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
