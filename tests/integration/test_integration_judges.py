"""Several rewards, a remote reward model and judges end to end (docs/rewards.md, issue 25):

- GRPO scored by reward.functions with reward.weights, a remote reward model (reward.url)
  and a tiny local judge model (reward.judge=model): every component is logged as
  objective/score_<name>, the raw score is their weighted sum, the actor trains and the
  judge stays frozen;
- GRPO scored by an HTTP judge (reward.judge=url, an OpenAI-compatible stub on 127.0.0.1):
  batching, a timeout and an error answer retried, the API key sent and never written;
  then `rlhf-dist eval`'s judge win rate against eval.reference, recomputed from what the
  judge was asked.

Servers are tests/http_stub.py; runs are in-process on the session runtime.
"""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import torch
from http_stub import StubServer, chat_reply
from spies import capture_calls

from rlhf_dist.config import config_from_dict
from rlhf_dist.demo import task
from rlhf_dist.evaluate import run_eval
from rlhf_dist.rewards import scoring as models_module  # where the judge is loaded
from rlhf_dist.trainers import ppo
from rlhf_dist.trainers.ppo import setup as ppo_setup

KEY = "sk-judge-7c2e91-never-write-me"
TEMPLATE = "P: {prompt} R: {response}"  # the stubs read the response back from it
DIGITS = [str(d) for d in range(10)]


def digit_judge(directory: Path, seed: int = 0) -> Path:
    """A tiny causal LM that reads the demo's words and writes only digits: the demo
    tokenizer's words plus "0".."9", a random tiny Llama whose output rows are zero except
    the digits', so greedy decoding picks the digit of largest (positive) logit, a
    function of the prompt it read: a judge whose every reply parses as a number."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate((*task.SPECIAL_TOKENS, *task.all_words(), *DIGITS))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(list(task.SPECIAL_TOKENS))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
        unk_token="<unk>", clean_up_tokenization_spaces=False,
    )  # fmt: skip
    config = task.tiny_llama_config(
        len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, size="tiny"
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        keep = torch.zeros(len(tok), dtype=torch.bool)
        keep[[vocab[d] for d in DIGITS]] = True
        model.lm_head.weight[~keep] = 0.0
    model.save_pretrained(directory, safe_serialization=True)
    tok.save_pretrained(directory)
    return directory


def judged_response(prompt_text: str) -> str:
    return prompt_text.split(" R: ", 1)[1]


def grpo_tree(out, policy, data, reward: dict, iterations: int = 2) -> dict:
    return {
        "run": {"output_dir": str(out), "seed": 0, "log_every": 1},
        "model": {"policy": str(policy)},
        "data": data,
        "generation": {"max_new_tokens": 8, "temperature": 0.7},
        "reward": {"judge_template": TEMPLATE, "retry_delay_s": 0.0, **reward},
        "ppo": {
            "estimator": "grpo",
            "iterations": iterations,
            "rollout_batch_size": 4,
            "samples_per_prompt": 4,
            "rollout_micro_batch_size": 16,
            "ppo_epochs": 1,
            "minibatch_size": 16,
            "micro_batch_size": 16,
            "optim": {"lr": 1e-3},
        },
    }


def test_grpo_with_weighted_functions_a_remote_rm_and_a_local_judge(
    sft_run, task_env, runtime, tmp_path, monkeypatch, data_cfg, saved_state_dict,
    changed_tensors, read_jsonl,
):  # fmt: skip
    judge_dir = digit_judge(tmp_path / "judge")
    judges = []  # the judge model as build_judge_reward loaded it
    load = models_module.load_causal_lm

    def spy_load(path, key, *args, **kwargs):
        model = load(path, key, *args, **kwargs)
        if key == "reward.judge_model":
            judges.append(model)
        return model

    monkeypatch.setattr(models_module, "load_causal_lm", spy_load)
    built = capture_calls(monkeypatch, ppo_setup, "build_models")

    def words(path, body, headers):  # the remote reward model: words per response
        return 200, {"scores": [float(len(r.split())) for r in body["responses"]]}

    policy, out = sft_run.out / "final", tmp_path / "run"
    reward = {
        "functions": [
            "rlhf_dist.demo.task:positive_word_reward",
            "rlhf_dist.demo.task:gold_reward_fn",
        ],
        "weights": [1.0, 0.5],
        "url_weight": 0.25,
        "judge": "model",
        "judge_model": str(judge_dir),
        "judge_max_new_tokens": 2,
        "remote_batch_size": 6,
    }
    with StubServer(words) as stub:
        reward["url"] = stub.url + "/score"
        tree = grpo_tree(out, policy, data_cfg(train=str(task_env.files.prompts)), reward)
        ppo.train_ppo(config_from_dict(tree), runtime)
    # 2 iterations x 16 responses, at most reward.remote_batch_size per request
    assert [len(b["responses"]) for _, b, _ in stub.requests] == [6, 6, 4] * 2

    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    weights = {"positive_word_reward": 1.0, "gold_reward_fn": 0.5, "remote": 0.25, "judge": 1.0}
    for row in rows:
        parts = {name: row[f"objective/score_{name}"] for name in weights}
        assert all(math.isfinite(v) for v in parts.values())
        assert row["objective/judge_parse_failures"] == 0.0  # a digit in every reply
        assert 0.0 <= parts["judge"] <= 9.0 and parts["remote"] >= 1.0
        # The score as the reward returned it is the weighted sum of the components' means.
        weighted = sum(weights[name] * v for name, v in parts.items())
        assert math.isclose(row["objective/raw_score"], weighted, rel_tol=1e-5, abs_tol=1e-6)

    ((_, _, trained),) = built
    net = runtime.unwrap(trained.model)
    initial = saved_state_dict(policy)
    assert changed_tensors(initial, net.actor.state_dict()) == list(initial)  # it trained
    # The judge: loaded once, frozen, out of the optimizer, its weights as saved.
    (judge,) = judges
    assert not any(p.requires_grad for p in judge.parameters())
    optimized = {id(p) for g in trained.optimizer.param_groups for p in g["params"]}
    assert optimized.isdisjoint(id(p) for p in judge.parameters())
    assert changed_tensors(saved_state_dict(judge_dir), judge.state_dict()) == []


class ChatJudge:
    """An OpenAI-compatible judge: 'Score: <positive words of the response>' for each
    chat completion; the first request answers 500 echoing the Authorization header (a key
    leak unless redacted), the second answers after `slow_s` (past the client's timeout).
    Tracks the most requests in flight at once (the slow one aside: it keeps sleeping here
    after the client gave up on it)."""

    def __init__(self, slow_s: float):
        self.slow_s, self.seen, self.in_flight, self.peak = slow_s, 0, 0, 0
        self.lock = threading.Lock()

    @staticmethod
    def score(response: str) -> int:
        return len(task._POS_SET.intersection(response.split()))

    def __call__(self, path, body, headers):
        with self.lock:
            self.seen += 1
            n = self.seen
            counted = n != 2
            self.in_flight += counted
            self.peak = max(self.peak, self.in_flight)
        try:
            if n == 1:
                return 500, {"error": f"refused {headers.get('Authorization')}"}
            if n == 2:
                time.sleep(self.slow_s)
            response = judged_response(body["messages"][0]["content"])
            return 200, chat_reply(f"Score: {self.score(response)}")
        finally:
            with self.lock:
                self.in_flight -= counted


def test_http_judge_trains_grpo_keeps_the_key_secret_and_gives_eval_a_win_rate(
    sft_run, task_env, runtime, tmp_path, monkeypatch, capfd, data_cfg, read_jsonl
):
    monkeypatch.setenv("TEST_JUDGE_KEY", KEY)
    judge = ChatJudge(slow_s=2.0)
    reward = {
        "judge": "url",
        "judge_model_name": "judge-1",
        "api_key_env": "TEST_JUDGE_KEY",
        "remote_batch_size": 4,
        "retries": 2,
        "timeout_s": 1.0,  # a local answer takes milliseconds; the slow one 2 s
    }
    out, data = tmp_path / "grpo", data_cfg(train=str(task_env.files.prompts))
    with StubServer(judge, max_requests=1000) as stub:
        reward["judge_url"] = stub.url + "/v1"
        tree = grpo_tree(out, sft_run.out / "final", data, reward, iterations=1)
        ppo.train_ppo(config_from_dict(tree), runtime)
        grpo_requests = list(stub.requests)
        eval_out = tmp_path / "eval"
        eval_cfg = config_from_dict(
            {
                "run": {"output_dir": str(eval_out), "seed": 0},
                "model": {"policy": str(out / "final")},
                "data": data_cfg(train=str(task_env.files.eval_prompts)),
                "generation": {"max_new_tokens": 8, "temperature": 0.7},
                "reward": reward | {"judge_template": TEMPLATE, "retry_delay_s": 0.0},
                "eval": {"reference": str(task_env.policy), "num_prompts": 8, "batch_size": 8},
            }
        )
        summary = run_eval(eval_cfg, runtime)
        eval_requests = stub.requests[len(grpo_requests) :]

    # 16 responses judged, the failed and the timed-out request each retried once
    assert len(grpo_requests) == 16 + 2
    assert all(path == "/v1/chat/completions" for path, _, _ in grpo_requests)
    assert all(h.get("Authorization") == f"Bearer {KEY}" for _, _, h in grpo_requests)
    assert {b["model"] for _, b, _ in grpo_requests} == {"judge-1"}
    assert 1 <= judge.peak <= 4  # reward.remote_batch_size requests at a time
    (row,) = read_jsonl(out / "metrics.jsonl")
    assert row["objective/judge_parse_failures"] == 0.0 and math.isfinite(row["objective/score"])

    printed = capfd.readouterr()
    assert printed.err.count("retrying") >= 2 and "***" in printed.err
    written = [p for d in (out, eval_out) for p in d.rglob("*") if p.is_file()]
    assert written and not any(KEY.encode() in p.read_bytes() for p in written)
    assert KEY not in printed.out + printed.err

    # Eval: each prompt's policy response is judged twice (its score, then the comparison)
    # and the reference's once; the win rate is recomputed from the judge's own scores.
    samples = read_jsonl(eval_out / "samples.jsonl")
    asked: dict[str, list[str]] = {}
    for _, body, _ in eval_requests:
        prompt, response = body["messages"][0]["content"][3:].split(" R: ", 1)
        asked.setdefault(prompt, []).append(response)
    assert len(samples) == len(asked) == 8 and len(eval_requests) == 3 * 8
    wins = []
    for s in samples:
        responses = asked[s["prompt"]]
        assert responses.count(s["response"]) >= 2 and s["score"] == judge.score(s["response"])
        responses.remove(s["response"])
        responses.remove(s["response"])
        policy, reference = judge.score(s["response"]), judge.score(responses[0])
        wins.append(1.0 if policy > reference else 0.5 if policy == reference else 0.0)
    assert math.isclose(summary["judge_win_rate"], sum(wins) / len(wins), abs_tol=1e-6)
