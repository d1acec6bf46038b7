"""Chat models and conversational data end to end (docs/data.md), on tiny Llamas with the
two word-level chat tokenizers of the demo task: "chatml" (policy side) and "llama3" (a
reward model with another vocabulary and template).

- SFT on `messages` rows trains, its loss falling;
- a reward model trains on conversational pairs with an implicit prompt;
- PPO on conversational prompts with the other tokenizer's reward model runs, and that
  model reads exactly its own template's rendering of prompt + response;
- a critic started from that reward model is refused;
- an SFT export carries data.chat_template for the next stage;
- eval probes that reward model for length bias in its own tokens.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from chat_tokenizers import build_chat_tokenizer

from rlhf_dist.config import ConfigError, config_from_dict
from rlhf_dist.demo import task
from rlhf_dist.rewards import scoring

N_ROWS = 64


def _user(text):
    return {"role": "user", "content": text}


def _assistant(text):
    return {"role": "assistant", "content": text}


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def chat_env(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    rng = random.Random(0)
    toks, models = {}, {}
    for style in ("chatml", "llama3"):
        toks[style] = build_chat_tokenizer(root / f"tok_{style}", style)
        models[style] = task.build_tiny_models(root / f"models_{style}", toks[style], seed=0)
    sft, prefs, prompts = [], [], []
    for _ in range(N_ROWS):
        prompt, category = task.make_prompt(rng)
        good = task.sample_response(rng, category, 0.9)
        bad = task.sample_response(rng, category, 0.1)
        sft.append(
            {"messages": [{"role": "system", "content": "review"}, _user(prompt), _assistant(good)]}
        )
        turn = [_user(prompt)]
        prefs.append({"chosen": turn + [_assistant(good)], "rejected": turn + [_assistant(bad)]})
        prompts.append({"prompt": turn})
    files = {
        "sft": _write(root / "sft_messages.jsonl", sft),
        "prefs": _write(root / "prefs_implicit.jsonl", prefs),
        "prompts": _write(root / "prompts.jsonl", prompts),
    }
    return {"toks": toks, "models": models, "files": files}


DATA = {"max_prompt_length": 24, "max_length": 64}


def test_sft_on_messages_trains(chat_env, runtime, tmp_path, read_jsonl, capsys):
    from rlhf_dist.trainers.sft import train_sft

    cfg = config_from_dict(
        {
            "run": {"output_dir": str(tmp_path), "log_every": 1},
            "model": {"policy": str(chat_env["models"]["chatml"]["policy"])},
            "data": {**DATA, "train": str(chat_env["files"]["sft"])},
            "sft": {"epochs": 3, "batch_size": 16, "micro_batch_size": 16, "optim": {"lr": 3e-3}},
        }
    )
    summary = train_sft(cfg, runtime)
    assert f"sft data: {N_ROWS} kept" in capsys.readouterr().out
    losses = [r["sft/loss"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "sft/loss" in r]
    assert summary["steps"] == 3 * N_ROWS // 16 == len(losses)
    assert losses[-1] < losses[0] - 0.5, losses


def test_reward_model_on_conversational_pairs(chat_env, runtime, tmp_path, capsys):
    from rlhf_dist.trainers.reward import train_reward_model

    cfg = config_from_dict(
        {
            "run": {"output_dir": str(tmp_path), "log_every": 1},
            "model": {"policy": str(chat_env["models"]["llama3"]["policy"])},
            "data": {
                **DATA,
                "train": str(chat_env["files"]["prefs"]),
                "eval": str(chat_env["files"]["prefs"]),
            },
            "rm": {"epochs": 4, "batch_size": 16, "micro_batch_size": 16, "optim": {"lr": 3e-3}},
        }
    )
    summary = train_reward_model(cfg, runtime)
    assert f"preference pairs: {N_ROWS} kept" in capsys.readouterr().out
    assert summary["train_pairs"] == summary["eval_pairs"] == N_ROWS
    # Positive (0.9) vs negative (0.1) reviews: learnable in a few steps.
    assert summary["eval_accuracy"] > 0.75, summary


def test_sft_export_carries_data_chat_template(chat_env, runtime, tmp_path):
    """A tokenizer without a template, trained with data.chat_template (a file): final/
    saves it, so a later stage renders the same conversation with no template key."""
    from transformers import AutoTokenizer

    from rlhf_dist.data.rows import prompt_set
    from rlhf_dist.trainers.sft import train_sft

    plain = task.build_tokenizer(tmp_path / "plain")
    policy = task.build_tiny_models(tmp_path / "models", plain, seed=0)["policy"]
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    data = {**DATA, "train": str(chat_env["files"]["sft"]), "chat_template": str(template)}
    cfg = config_from_dict(
        {
            "run": {"output_dir": str(tmp_path / "sft")},
            "model": {"policy": str(policy)},
            "data": data,
            "sft": {"batch_size": N_ROWS, "micro_batch_size": N_ROWS},
        }
    )
    train_sft(cfg, runtime)
    exported = AutoTokenizer.from_pretrained(tmp_path / "sft" / "final")
    assert exported.chat_template == template.read_text()
    prompts = [{"prompt": [_user("review of the food :")]}]
    with_key = prompt_set(prompts, plain, cfg.data)
    without_key = prompt_set(prompts, exported, config_from_dict({}).data)
    assert with_key.ids == without_key.ids


def _ppo_cfg(chat_env, out, **ppo):
    return config_from_dict(
        {
            "run": {"output_dir": str(out), "log_every": 1, "samples_every": 1},
            "model": {
                "policy": str(chat_env["models"]["chatml"]["policy"]),
                "reward": str(chat_env["models"]["llama3"]["reward"]),
            },
            "data": {**DATA, "train": str(chat_env["files"]["prompts"])},
            "generation": {"max_new_tokens": 8, "temperature": 1.0},
            "ppo": {
                "iterations": 1,
                "rollout_batch_size": 8,
                "rollout_micro_batch_size": 8,
                "ppo_epochs": 1,
                "minibatch_size": 8,
                "micro_batch_size": 8,
                "critic_init": "policy",
                **ppo,
            },
        }
    )


def _llama3_tokens(prompt: list[dict], response: str, finished: bool) -> list[str]:
    """The Llama-3 template's rendering of prompt + response, token by token (by hand)."""
    out = ["<|begin_of_text|>"]
    for m in prompt:
        out += [
            "<|start_header_id|>",
            m["role"],
            "<|end_header_id|>",
            *m["content"].split(),
            "<|eot_id|>",
        ]
    out += ["<|start_header_id|>", "assistant", "<|end_header_id|>", *response.split()]
    return out + (["<|eot_id|>"] if finished else [])


def test_ppo_with_a_reward_model_of_another_tokenizer(
    chat_env, runtime, tmp_path, monkeypatch, read_jsonl
):
    from rlhf_dist.trainers.ppo import train_ppo

    calls, rm_inputs = [], []
    original_call, original_scores = scoring.Scorer.__call__, scoring.sequence_scores

    def scorer_call(
        self, prompts, responses, input_ids, attention_mask, last_index, columns=None, ids=None
    ):
        calls.append((prompts, responses, input_ids.clone(), last_index.clone()))
        return original_call(
            self, prompts, responses, input_ids, attention_mask, last_index, columns, ids
        )

    def sequence_scores(model, input_ids, attention_mask, last_index):
        rm_inputs.append((input_ids.clone(), attention_mask.clone(), last_index.clone()))
        return original_scores(model, input_ids, attention_mask, last_index)

    monkeypatch.setattr(scoring.Scorer, "__call__", scorer_call)
    monkeypatch.setattr(scoring, "sequence_scores", sequence_scores)
    summary = train_ppo(_ppo_cfg(chat_env, tmp_path), runtime)
    assert summary["iterations"] == 1 and torch.isfinite(torch.tensor(summary["score"]))

    policy_tok, rm_tok = chat_env["toks"]["chatml"], chat_env["toks"]["llama3"]
    # The policy's stop ids, from its tokenizer by hand: EOS and ChatML's end of turn.
    stops = {policy_tok.eos_token_id, policy_tok.get_vocab()["<|im_end|>"]}
    (prompts, responses, policy_ids, last), (rm_ids, rm_mask, rm_last) = calls[0], rm_inputs[0]
    assert len(calls) == len(rm_inputs) == 1 and len(prompts) == 8
    vocab = rm_tok.get_vocab()
    for b in range(8):
        assert isinstance(prompts[b], list) and prompts[b][-1]["role"] == "user"
        finished = int(policy_ids[b, last[b]]) in stops
        want = [vocab[t] for t in _llama3_tokens(prompts[b], responses[b], finished)]
        assert rm_ids[b][rm_mask[b].bool()].tolist() == want, b
        assert int(rm_last[b]) == len(want) - 1
    samples = read_jsonl(tmp_path / "samples.jsonl")
    assert samples[0]["prompt"].startswith("user: ")


def test_critic_from_a_reward_model_of_another_tokenizer_is_refused(chat_env, runtime, tmp_path):
    from rlhf_dist.trainers.ppo import train_ppo

    with pytest.raises(ConfigError, match=r"^ppo\.critic_init: .*critic_init=policy"):
        train_ppo(_ppo_cfg(chat_env, tmp_path / "out", critic_init="reward"), runtime)
    assert not (tmp_path / "out").exists()


def test_eval_probes_a_reward_model_of_another_tokenizer(chat_env, runtime, tmp_path):
    """`rlhf-dist eval` runs the length and rephrasing probes of a reward model with its
    own tokenizer, in that model's tokens (RewardInputs.probe_response)."""
    from rlhf_dist.evaluate import run_eval

    cfg = config_from_dict(
        {
            "run": {"output_dir": str(tmp_path)},
            "model": {
                "policy": str(chat_env["models"]["chatml"]["policy"]),
                "reward": str(chat_env["models"]["llama3"]["reward"]),
            },
            "data": {**DATA, "train": str(chat_env["files"]["prompts"])},
            "generation": {"max_new_tokens": 16, "temperature": 1.0},
            "eval": {"num_prompts": 32, "batch_size": 32},
        }
    )
    summary = run_eval(cfg, runtime)
    assert "length_corr" in summary
    assert summary["rephrase_responses"] > 0, summary  # finished responses were probed
    assert summary["rephrase_longer_delta"] is not None
