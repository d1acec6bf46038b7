"""Unit tests of rlhf_dist.data: padding, SFT/preference examples, collators, file loading.

The tokenizer is the demo task's word-level one: every word is exactly one token and
encoding adds no special tokens, so expected ids can be written down by hand.
"""

import csv
import json

import datasets
import pytest
import torch

from rlhf_dist.config import ConfigError, DataConfig
from rlhf_dist.data.rows import (
    PreferencePair,
    SFTExample,
    collate_pairs,
    collate_sft,
    left_pad,
    load_data,
    load_rows,
    preference_pairs,
    prompt_set,
    right_pad,
    sft_examples,
)
from rlhf_dist.demo.task import build_tokenizer

PROMPT = "review of the food :"  # 5 tokens


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def ids(tok, text: str) -> list[int]:
    """Word ids with no specials; fails loudly if a word is not in the vocabulary."""
    vocab = tok.get_vocab()
    return [vocab[w] for w in text.split()]


def count(report, *words: str) -> int:
    """Rows skipped for reasons whose text contains all `words` (reason wording may vary)."""
    return sum(n for reason, n in report.skipped.items() if all(w in reason for w in words))


def test_tokenizer_assumptions(tok):
    # Everything below relies on these; if they change, the hand-made expectations do too.
    assert tok(PROMPT)["input_ids"] == ids(tok, PROMPT)
    assert len(ids(tok, PROMPT)) == 5
    assert tok.pad_token_id != tok.eos_token_id


# ----------------------------------------------------------------------------- padding


def test_left_pad():
    out, mask = left_pad([[5, 6, 7], [8], []], pad_id=0)
    assert out.tolist() == [[5, 6, 7], [0, 0, 8], [0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 0]]
    assert out.dtype == torch.long


def test_right_pad():
    out, mask = right_pad([[5, 6], [7, 8, 9, 4], [3]], pad_id=1)
    assert out.tolist() == [[5, 6, 1, 1], [7, 8, 9, 4], [3, 1, 1, 1]]
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert out.dtype == torch.long


def test_pad_id_equal_to_a_real_token_is_still_masked_by_position():
    # The mask comes from lengths, never from comparing ids with pad_id.
    out, mask = right_pad([[0, 0], [0]], pad_id=0)
    assert mask.tolist() == [[1, 1], [1, 0]]
    out, mask = left_pad([[0, 0], [0]], pad_id=0)
    assert mask.tolist() == [[1, 1], [0, 1]]


# --------------------------------------------------------------------------------- SFT


def test_collate_sft_loss_mask_by_hand():
    eos, pad = 1, 0
    batch = [
        SFTExample(ids=[10, 11, 20, 21, eos], prompt_len=2),  # 2 prompt, 2 response + EOS
        SFTExample(ids=[10, 11, 12, eos], prompt_len=3),  # empty response: EOS only
        SFTExample(ids=[10, 20, eos], prompt_len=1),
    ]
    out = collate_sft(batch, pad)
    assert out["input_ids"].tolist() == [
        [10, 11, 20, 21, eos],
        [10, 11, 12, eos, pad],
        [10, 20, eos, pad, pad],
    ]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 0, 0]]
    # loss_mask[b, t]: the logits at t predict token t+1; True iff t+1 is a response
    # token (EOS included), never a prompt token or padding.
    assert out["loss_mask"].tolist() == [
        [False, True, True, True],
        [False, False, True, False],
        [True, True, False, False],
    ]


def test_collate_sft_loss_mask_matches_definition(tok):
    cfg = DataConfig(max_prompt_length=16, max_length=32)
    rows = [
        {"prompt": PROMPT, "response": "the food was great"},
        {"prompt": "review of", "response": "awful"},
        {"prompt": "the", "response": "the food was really great and the staff was lovely"},
    ]
    examples, _ = sft_examples(rows, tok, cfg)
    out = collate_sft(examples, tok.pad_token_id)
    targets = out["input_ids"][:, 1:]
    for b, ex in enumerate(examples):
        for t in range(targets.shape[1]):
            expected = ex.prompt_len <= t + 1 < len(ex.ids)
            assert bool(out["loss_mask"][b, t]) == expected, (b, t)
        # The last target under the mask is the EOS.
        last = int(out["loss_mask"][b].nonzero().max())
        assert int(targets[b, last]) == tok.eos_token_id


def test_sft_examples_encode_prompt_response_eos(tok):
    cfg = DataConfig(max_prompt_length=16, max_length=32)
    examples, report = sft_examples(
        [{"prompt": PROMPT, "response": "the food was great"}], tok, cfg
    )
    assert report.kept == 1 and not report.skipped
    (ex,) = examples
    assert ex.ids == ids(tok, PROMPT) + ids(tok, "the food was great") + [tok.eos_token_id]
    assert ex.prompt_len == 5


def test_sft_examples_skip_and_count(tok):
    cfg = DataConfig(max_prompt_length=8, max_length=12)
    good = {"prompt": PROMPT, "response": "great"}
    rows = [
        good,
        {"response": "great"},  # missing prompt
        {"prompt": PROMPT},  # missing response
        {"prompt": PROMPT, "response": None},  # missing response (null, as datasets fills)
        {"prompt": 7, "response": "great"},  # prompt not text
        {"prompt": PROMPT, "response": ["great"]},  # response not text
        {"prompt": "   ", "response": "great"},  # whitespace prompt
        {"prompt": PROMPT, "response": " \n"},  # whitespace response
        # 5 prompt + 7 response + EOS = 13 > max_length 12
        {"prompt": PROMPT, "response": "the food was great and very lovely"},
        # 5 + 6 + EOS = 12: exactly at the limit, kept
        {"prompt": PROMPT, "response": "the food was great and lovely"},
        good,
    ]
    examples, report = sft_examples(rows, tok, cfg)
    assert report.kept == len(examples) == 3
    assert count(report, "missing", "prompt") == 1
    assert count(report, "missing", "response") == 2
    assert count(report, "prompt", "not text") == 1
    assert count(report, "response", "not text") == 1
    assert count(report, "empty", "prompt") == 1
    assert count(report, "empty", "response") == 1
    assert count(report, "max_length") == 1
    assert sum(report.skipped.values()) == len(rows) - 3
    assert max(len(ex.ids) for ex in examples) == 12
    # The summary a user reads mentions both figures.
    assert "3 kept" in report.summary("sft") and "8 skipped" in report.summary("sft")


@pytest.mark.parametrize("too_long", ["drop", "truncate"])
def test_long_prompts_drop_or_keep_their_end(tok, too_long):
    cfg = DataConfig(max_prompt_length=3, max_length=20, too_long=too_long)
    rows = [
        {"prompt": PROMPT, "response": "great"},  # 5 tokens > 3
        {"prompt": "of the food", "response": "awful"},  # exactly 3: untouched
    ]
    examples, report = sft_examples(rows, tok, cfg)
    if too_long == "drop":
        assert count(report, "prompt too long") == 1
        assert report.truncated == 0
        assert [ex.ids for ex in examples] == [ids(tok, "of the food awful") + [tok.eos_token_id]]
    else:
        assert not report.skipped and report.truncated == 1
        # The LAST 3 prompt tokens survive: "the food :".
        assert examples[0].ids == ids(tok, "the food : great") + [tok.eos_token_id]
        assert examples[0].prompt_len == 3
        assert examples[1].ids == ids(tok, "of the food awful") + [tok.eos_token_id]
        assert "truncated" in report.summary("sft")


# -------------------------------------------------------------------------- preferences


def pair_ids(tok, prompt: str, response: str) -> list[int]:
    return ids(tok, prompt) + ids(tok, response) + [tok.eos_token_id]


def test_preference_pairs_skip_and_count(tok):
    cfg = DataConfig(max_prompt_length=8, max_length=10)
    good = {"prompt": PROMPT, "chosen": "great", "rejected": "awful", "category": "food"}
    rows = [
        good,
        {"chosen": "great", "rejected": "awful"},  # missing prompt
        {"prompt": PROMPT, "rejected": "awful"},  # missing chosen
        {"prompt": PROMPT, "chosen": "great"},  # missing rejected
        {"prompt": PROMPT, "chosen": 1.5, "rejected": "awful"},  # chosen not text
        {"prompt": PROMPT, "chosen": "great", "rejected": ""},  # empty rejected
        {"prompt": PROMPT, "chosen": "great", "rejected": "great"},  # identical
        {"prompt": PROMPT, "chosen": "great ", "rejected": " great"},  # identical after strip
        # rejected: 5 + 5 + EOS = 11 > 10
        {"prompt": PROMPT, "chosen": "great", "rejected": "the food was very bland"},
    ]
    pairs, report = preference_pairs(rows, tok, cfg)
    assert report.kept == len(pairs) == 1
    assert pairs[0] == PreferencePair(
        pair_ids(tok, PROMPT, "great"), pair_ids(tok, PROMPT, "awful"), "food", prompt_len=5
    )
    assert count(report, "missing", "prompt") == 1
    assert count(report, "missing", "chosen") == 1
    assert count(report, "missing", "rejected") == 1
    assert count(report, "chosen", "not text") == 1
    assert count(report, "empty", "rejected") == 1
    assert count(report, "chosen == rejected") == 2
    assert count(report, "max_length") == 1
    assert sum(report.skipped.values()) == len(rows) - 1


def test_preference_prompt_too_long(tok):
    rows = [{"prompt": PROMPT, "chosen": "great", "rejected": "awful"}]
    drop = DataConfig(max_prompt_length=2, max_length=20, too_long="drop")
    pairs, report = preference_pairs(rows, tok, drop)
    assert pairs == [] and count(report, "prompt too long") == 1
    keep = DataConfig(max_prompt_length=2, max_length=20, too_long="truncate")
    pairs, report = preference_pairs(rows, tok, keep)
    assert report.truncated == 1
    assert pairs[0].chosen == pair_ids(tok, "food :", "great")
    assert pairs[0].rejected == pair_ids(tok, "food :", "awful")


@pytest.mark.parametrize(
    "responses",
    [
        ["great", "bland", "awful"],
        ["excellent", "great really", "bland", "awful"],
    ],
)
def test_ranked_lists_expand_best_first(tok, responses):
    cfg = DataConfig(max_prompt_length=8, max_length=20)
    pairs, report = preference_pairs([{"prompt": PROMPT, "responses": responses}], tok, cfg)
    n = len(responses)
    assert report.kept == len(pairs) == n * (n - 1) // 2
    expected = [
        (pair_ids(tok, PROMPT, responses[i]), pair_ids(tok, PROMPT, responses[j]))
        for i in range(n)
        for j in range(i + 1, n)
    ]
    assert [(p.chosen, p.rejected) for p in pairs] == expected


def test_bad_ranked_lists_are_skipped(tok):
    cfg = DataConfig(max_prompt_length=8, max_length=20)
    rows = [
        {"prompt": PROMPT, "responses": ["great"]},  # fewer than 2
        {"prompt": PROMPT, "responses": "great"},  # not a list
        {"prompt": PROMPT, "responses": ["great", "  "]},  # empty entry
        {"prompt": PROMPT, "responses": ["great", 3]},  # non-text entry
    ]
    pairs, report = preference_pairs(rows, tok, cfg)
    assert pairs == []
    assert sum(report.skipped.values()) == 4


def test_responses_field_name_is_configurable(tok):
    cfg = DataConfig(max_prompt_length=8, max_length=20)
    rows = [{"prompt": PROMPT, "ranking": ["great", "bland", "awful"]}]
    pairs, _ = preference_pairs(rows, tok, cfg, responses_field="ranking")
    assert len(pairs) == 3


def test_ranked_list_with_duplicate_entries_skips_identical_pairs(tok):
    cfg = DataConfig(max_prompt_length=8, max_length=20)
    rows = [{"prompt": PROMPT, "responses": ["great", "great", "awful"]}]
    pairs, report = preference_pairs(rows, tok, cfg)
    assert all(p.chosen != p.rejected for p in pairs)
    assert count(report, "chosen == rejected") == 1


def test_file_mixing_pairs_and_ranked_lists(tok, tmp_path):
    path = tmp_path / "prefs.jsonl"
    rows = [
        {"prompt": PROMPT, "chosen": "great", "rejected": "awful"},
        {"prompt": PROMPT, "responses": ["great", "bland", "awful"]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(max_prompt_length=8, max_length=20)
    pairs, report = preference_pairs(load_rows(str(path), "data.train"), tok, cfg)
    assert not report.skipped
    assert len(pairs) == 1 + 3


def test_collate_pairs_stacks_chosen_then_rejected(tok):
    eos, pad = tok.eos_token_id, tok.pad_token_id
    batch = [
        PreferencePair(chosen=[10, 11, eos], rejected=[10, 12, 13, 14, eos]),
        PreferencePair(chosen=[20, 21, 22, eos], rejected=[20, eos]),
    ]
    out = collate_pairs(batch, pad)
    assert out["input_ids"].tolist() == [
        [10, 11, eos, pad, pad],
        [20, 21, 22, eos, pad],
        [10, 12, 13, 14, eos],
        [20, eos, pad, pad, pad],
    ]
    assert out["last_index"].tolist() == [2, 3, 4, 1]
    rows = torch.arange(4)
    assert (out["input_ids"][rows, out["last_index"]] == eos).all()
    assert out["attention_mask"].sum(1).tolist() == [3, 4, 5, 2]


# ----------------------------------------------------------------------------- loading


ROWS = [
    {"prompt": "review of the food :", "chosen": "great", "rejected": "awful"},
    {"prompt": "review of the hotel :", "chosen": "lovely", "rejected": "dirty"},
]


def test_load_rows_jsonl(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert load_rows(str(path), "data.train") == ROWS


def test_load_rows_json_array(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps(ROWS))
    assert load_rows(str(path), "data.train") == ROWS


def test_load_rows_csv(tmp_path):
    path = tmp_path / "d.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(ROWS[0]))
        writer.writeheader()
        writer.writerows(ROWS)
    assert load_rows(str(path), "data.train") == ROWS


def test_load_rows_parquet_with_ranked_lists(tmp_path):
    path = tmp_path / "d.parquet"
    rows = [
        {"prompt": "review of the food :", "responses": ["great", "bland", "awful"]},
        {"prompt": "review of the hotel :", "responses": ["lovely", "dirty"]},
    ]
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    assert load_rows(str(path), "data.train") == rows


def test_hub_datasets_are_read_at_the_subset_and_each_keys_split(monkeypatch):
    # The hub is unreachable here: record what load_dataset is asked for.
    calls = []

    def hub(path, name=None, split=None):
        calls.append((path, name, split))
        return datasets.Dataset.from_list([{"question": f"{path}/{name}/{split}"}])

    monkeypatch.setattr(datasets, "load_dataset", hub)
    d = DataConfig(train="openai/gsm8k", eval="openai/gsm8k", subset="main")
    assert load_data(d, "train") == [{"question": "openai/gsm8k/main/train"}]
    assert load_data(d, "eval") == [{"question": "openai/gsm8k/main/test"}]
    plain = DataConfig(train="org/prompts", split="validation")
    load_data(plain, "train")
    assert calls[-1] == ("org/prompts", None, "validation")


def test_load_rows_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"^data\.eval: .*does not exist"):
        load_rows(str(tmp_path / "absent.jsonl"), "data.eval")
    text = tmp_path / "d.txt"
    text.write_text("prompt\n")
    with pytest.raises(ConfigError, match=r"^data\.train: .*\.jsonl"):
        load_rows(str(text), "data.train")
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    with pytest.raises(ConfigError, match=r"^data\.train: cannot load") as info:
        load_rows(str(broken), "data.train")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
@pytest.mark.parametrize("content", [b"", b"\n  \n\n"], ids=["0 bytes", "blank lines"])
def test_empty_data_file_is_named_as_empty(tmp_path, suffix, content):
    path = tmp_path / f"d{suffix}"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        load_rows(str(path), "data.eval")
    assert str(info.value) == f"data.eval: data file {str(path)!r} is empty"


def write_no_rows(path):
    if path.suffix == ".parquet":
        datasets.Dataset.from_dict({"prompt": []}).to_parquet(str(path))
    else:  # a CSV header line, or an empty JSON list
        path.write_text("prompt\n" if path.suffix == ".csv" else " [ ]\n")


@pytest.mark.parametrize("suffix", [".json", ".csv", ".parquet"])
def test_data_file_without_rows_says_so(tmp_path, suffix):
    path = tmp_path / f"d{suffix}"
    write_no_rows(path)
    with pytest.raises(ConfigError, match=r"^data\.train: data file .* has .*no rows"):
        load_rows(str(path), "data.train")


# ----------------------------------------------------------------------------- prompts


def test_prompt_set_keeps_usable_prompts(tok):
    cfg = DataConfig(prompt_field="query", max_prompt_length=3, too_long="truncate")
    rows = [{"query": PROMPT}, {"query": ""}, {"prompt": "ignored"}, {"query": "of the"}]
    ps = prompt_set(rows, tok, cfg)
    assert ps.texts == [PROMPT, "of the"]
    assert ps.ids == [ids(tok, "the food :"), ids(tok, "of the")]
    assert ps.report.kept == 2 and ps.report.truncated == 1
    assert sum(ps.report.skipped.values()) == 2


def test_prompt_set_without_usable_prompts_raises(tok):
    cfg = DataConfig(max_prompt_length=2, too_long="drop")
    rows = [{"prompt": PROMPT}, {"prompt": " "}, {"text": "the food"}]
    with pytest.raises(ConfigError, match=r"^data: no usable prompts") as info:
        prompt_set(rows, tok, cfg)
    assert "\n" not in str(info.value)
