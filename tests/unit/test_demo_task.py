"""Tests of the offline demo task (rlhf_dist.demo.task): data, gold reward, tokenizer, models."""

import json
import math
import random
from pathlib import Path

import pytest

from rlhf_dist.demo import task
from rlhf_dist.demo.task import (
    CATEGORIES,
    NEGATIVE,
    POSITIVE,
    bayes_accuracy,
    bt_label,
    gold_reward,
    gold_reward_fn,
    gold_rewards,
    make_prompt,
    positive_word_reward,
    sample_response,
    write_task,
)

SMALL = dict(n_sft=300, n_pref=300, n_pref_eval=500, n_prompts=64, n_eval_prompts=32)


def _read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _all_files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.fixture(scope="module")
def task_files(tmp_path_factory):
    return write_task(tmp_path_factory.mktemp("demo_task"), seed=0, **SMALL)


def test_vocabulary_lists():
    assert len(POSITIVE) >= 12 and len(NEGATIVE) >= 12
    assert not set(POSITIVE) & set(NEGATIVE)
    assert len(set(CATEGORIES)) == len(CATEGORIES) >= 4
    assert len(task.all_words()) <= 150


def test_write_task_deterministic(tmp_path, task_files):
    again = write_task(tmp_path / "again", seed=0, **SMALL)
    assert _all_files(task_files.root) == _all_files(again.root)
    other = write_task(tmp_path / "other", seed=1, **SMALL)
    assert task_files.sft.read_bytes() != other.sft.read_bytes()
    meta = json.loads((task_files.root / "task.json").read_text())
    assert meta["seed"] == 0 and meta["beta"] == 10.0 and meta["n_sft"] == SMALL["n_sft"]


def test_write_task_rows(task_files):
    sft = _read_jsonl(task_files.sft)
    assert len(sft) == SMALL["n_sft"] and set(sft[0]) == {"prompt", "response"}
    keys = {"prompt", "chosen", "rejected", "category", "chosen_gold", "rejected_gold"}
    for path, n in ((task_files.prefs_train, "n_pref"), (task_files.prefs_eval, "n_pref_eval")):
        rows = _read_jsonl(path)
        assert len(rows) == SMALL[n] and all(set(r) == keys for r in rows)
        assert all(r["chosen_gold"] == gold_reward(r["chosen"]) for r in rows)
    prompts = _read_jsonl(task_files.prompts)
    eval_prompts = _read_jsonl(task_files.eval_prompts)
    assert len(prompts) == SMALL["n_prompts"] and len(eval_prompts) == SMALL["n_eval_prompts"]
    assert all(set(r) == {"prompt", "category"} for r in prompts + eval_prompts)
    assert not {r["prompt"] for r in prompts} & {r["prompt"] for r in eval_prompts}
    assert all(r["prompt"].endswith(" :") and r["category"] in r["prompt"] for r in prompts)


def test_gold_reward_hand_cases():
    varied_pos = "the food was great and the staff was lovely , i loved the menu"
    assert gold_reward(varied_pos) == 1.0
    assert gold_reward("the food was awful and the staff was rude") == 0.0
    mixed = "the food was great and the room was lovely but the staff was rude"
    assert gold_reward(mixed) == pytest.approx(2 / 3)
    assert gold_reward("the room was clean") == 0.5  # no sentiment words
    assert gold_reward("") == 0.0 and gold_reward("   ") == 0.0
    assert gold_reward(varied_pos, finished=False) == pytest.approx(0.5)
    assert gold_reward(mixed, finished=False) == pytest.approx(1 / 3)
    repeated = gold_reward("great great great great")
    assert repeated < 0.5 * gold_reward(varied_pos)
    # repeating a sentiment word (not adjacent) is penalised, but mildly
    rep = gold_reward("the food was great and the staff was great")
    assert 0.9 < rep < 1.0


def test_gold_reward_range_and_sft_mean(task_files):
    rng = random.Random(123)
    for _ in range(2000):
        _, category = make_prompt(rng)
        response = sample_response(rng, category, rng.random())
        words = response.split()
        assert 2 <= len(words) <= 20
        assert all(a != b for a, b in zip(words, words[1:], strict=False))
        r = gold_reward(response, finished=rng.random() < 0.5)
        assert 0.0 <= r <= 1.0
    junk = ["great " * 30, ". . . .", "<pad> <eos>", "rude rude great", "x"]
    assert all(0.0 <= r <= 1.0 for r in gold_rewards(junk, [True, False, True, True, False]))
    mean = sum(gold_rewards([r["response"] for r in _read_jsonl(task_files.sft)])) / SMALL["n_sft"]
    print(f"SFT mean gold reward: {mean:.3f}")
    assert 0.35 < mean < 0.65


def test_pos_share_controls_sentiment():
    rng = random.Random(0)
    assert all(gold_reward(sample_response(rng, "hotel", 1.0)) == 1.0 for _ in range(50))
    assert all(gold_reward(sample_response(rng, "book", 0.0)) == 0.0 for _ in range(50))


def test_reward_functions():
    responses = ["the food was great and i loved the menu", "the food was awful", ""]
    assert gold_reward_fn(["p"] * 3, responses) == gold_rewards(responses)
    scores = positive_word_reward(["p"] * 3, responses + ["great lovely superb amazing wonderful"])
    assert scores == [0.5, -0.25, 0.0, 1.0]
    assert positive_word_reward(["p"], ["great great"]) == [0.25]


def test_bt_label_matches_sigmoid():
    rng = random.Random(7)
    for gold_a, gold_b in ((0.6, 0.5), (0.3, 0.5), (0.5, 0.5), (1.0, 0.0)):
        p = 1 / (1 + math.exp(-10.0 * (gold_a - gold_b)))
        n = 20000
        share = sum(bt_label(rng, gold_a, gold_b, 10.0) for _ in range(n)) / n
        assert abs(share - p) < 4 * math.sqrt(p * (1 - p) / n) + 1e-3


def test_bayes_accuracy(task_files):
    sig = 1 / (1 + math.exp(-2.0))
    assert bayes_accuracy([0.7, 0.5, 0.2], [0.5, 0.5, 0.4], 10.0) == pytest.approx(
        (2 * sig + 0.5) / 3
    )
    rows = _read_jsonl(task_files.prefs_eval)
    acc = bayes_accuracy([r["chosen_gold"] for r in rows], [r["rejected_gold"] for r in rows], 10.0)
    print(f"eval pairs Bayes accuracy (beta 10): {acc:.3f}")
    assert acc > 0.8


def test_tokenizer_round_trip_and_reload(task_files):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(task_files.tokenizer_dir))
    built = task.build_tokenizer(task_files.root / "tok_again")
    assert tok.get_vocab() == built.get_vocab()
    assert tok.pad_token_id != tok.eos_token_id
    assert {tok.pad_token, tok.eos_token, tok.bos_token, tok.unk_token} == {
        "<pad>",
        "<eos>",
        "<bos>",
        "<unk>",
    }
    assert tok.padding_side == "right"
    texts = [r["response"] for r in _read_jsonl(task_files.sft)]
    texts += [r["prompt"] for r in _read_jsonl(task_files.prompts)]
    for text in texts:
        ids = tok(text)["input_ids"]
        assert ids == built(text)["input_ids"] == tok(text, add_special_tokens=True)["input_ids"]
        assert tok.unk_token_id not in ids
        assert tok.decode(ids) == text
    assert tok.decode(tok("the room was great")["input_ids"] + [tok.eos_token_id]).endswith("<eos>")


def test_tiny_models_load_and_run(tmp_path, task_files):
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(task_files.tokenizer_dir))
    cfg = task.tiny_llama_config(len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size) == (64, 2, 256)
    assert cfg.attention_dropout == 0.0 and not cfg.tie_word_embeddings
    small = task.tiny_llama_config(len(tok), 0, 2, 1, size="small")
    assert (small.hidden_size, small.num_hidden_layers, small.intermediate_size) == (128, 4, 512)
    paths = task.build_tiny_models(tmp_path / "models", tok, size="tiny", seed=0)
    assert (paths["policy"] / "model.safetensors").exists()
    policy = AutoModelForCausalLM.from_pretrained(str(paths["policy"]))
    reward = AutoModelForSequenceClassification.from_pretrained(str(paths["reward"]))
    assert reward.config.num_labels == 1 and reward.config.pad_token_id == tok.pad_token_id
    batch = tok(["review of the hotel : the room was great", "review of the book :"], padding=True)
    ids = torch.tensor(batch["input_ids"])
    mask = torch.tensor(batch["attention_mask"])
    with torch.no_grad():
        logits = policy(input_ids=ids, attention_mask=mask).logits
        scores = reward(input_ids=ids, attention_mask=mask).logits
    assert logits.shape == (2, ids.shape[1], len(tok)) and scores.shape == (2, 1)
    assert torch.isfinite(logits).all() and torch.isfinite(scores).all()
    again = task.build_tiny_models(tmp_path / "again", tok, size="tiny", seed=0)
    same = AutoModelForCausalLM.from_pretrained(str(again["policy"]))
    for a, b in zip(policy.parameters(), same.parameters(), strict=True):
        assert torch.equal(a, b)
