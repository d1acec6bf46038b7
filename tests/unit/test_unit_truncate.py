"""data.truncate: SFT / RM / DPO / KTO sequences longer than data.max_length are skipped
(none), cut at their end (right) or lose prompt tokens from their front (left), counted in
the load report (docs/data.md).

Real tokenizers from tests/chat_tokenizers.py: "llama3" adds BOS to every text encoding
and its template writes one; "chatml" has no BOS. Words are single tokens, so every
expected id sequence is written out by hand.
"""

import pytest
from chat_tokenizers import build_chat_tokenizer

from rlhf_dist.config import DataConfig
from rlhf_dist.data.rows import kto_examples, preference_pairs, sft_examples
from rlhf_dist.demo.task import build_tokenizer

PROMPT = "review of the food :"  # 5 words; llama3's tokenizer adds BOS: 6 tokens


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_toks")
    return {style: build_chat_tokenizer(root / style, style) for style in ("chatml", "llama3")}


def ids(tok, *tokens: str) -> list[int]:
    vocab = tok.get_vocab()
    return [vocab[t] for text in tokens for t in text.split()]


def cfg(truncate: str, max_length: int) -> DataConfig:
    return DataConfig(max_prompt_length=32, max_length=max_length, truncate=truncate)


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def chatml(role: str, text: str, close: bool = True) -> list[str]:
    return ["<|im_start|>", role, *text.split()] + (["<|im_end|>"] if close else [])


# ------------------------------------------------------------------ text prompt + response


def test_text_sft_each_mode(toks):
    tok = toks["llama3"]
    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    row = {"prompt": PROMPT, "response": "great food"}  # 6 + 2 + EOS = 9 tokens
    assert sft_examples([row], tok, cfg("none", 9))[0][0].ids == ids(
        tok, bos, PROMPT, "great food", eos
    )

    examples, report = sft_examples([row], tok, cfg("none", 7))
    assert examples == [] and dict(report.skipped) == {"longer than data.max_length": 1}
    assert report.cut == 0

    (ex,), report = sft_examples([row], tok, cfg("right", 7))
    # The first 7 tokens: the response keeps its start and is trained without its EOS.
    assert ex.ids == ids(tok, bos, PROMPT, "great")
    assert ex.targets() == [False] * 6 + [True]
    assert report.cut == 1 and not report.skipped
    assert "1 truncated to data.max_length" in report.summary("sft data")

    (ex,), report = sft_examples([row], tok, cfg("left", 7))
    # Two prompt tokens go from the front; the BOS stays, the response is whole.
    assert ex.ids == ids(tok, bos, "the food :", "great food", eos)
    assert ex.prompt_len == 4 and ex.targets() == [False] * 4 + [True] * 3
    assert report.cut == 1


def test_text_limits_of_each_mode_are_counted_skips(toks):
    tok = toks["llama3"]
    long_response = {"prompt": PROMPT, "response": "the food was very bland indeed"}  # 6 + 7
    examples, report = sft_examples([long_response], tok, cfg("left", 7))
    assert examples == [] and dict(report.skipped) == {"response alone fills data.max_length": 1}
    examples, report = sft_examples([{"prompt": PROMPT, "response": "great"}], tok, cfg("right", 6))
    assert examples == [] and dict(report.skipped) == {"prompt alone fills data.max_length": 1}


def test_left_without_a_bos_drops_from_the_first_token(toks):
    tok = toks["chatml"]  # no BOS: the prompt's first words go
    (ex,), _ = sft_examples([{"prompt": PROMPT, "response": "great"}], tok, cfg("left", 4))
    assert ex.ids == ids(tok, "food : great <eos>") and ex.prompt_len == 2


def test_prompt_and_sequence_truncation_are_counted_apart(tmp_path):
    tok = build_tokenizer(tmp_path / "tok")  # the demo's word-level tokenizer, no BOS
    data = DataConfig(max_prompt_length=4, max_length=6, truncate="left", too_long="truncate")
    rows = [
        {"prompt": PROMPT, "response": "great food"},
        {"prompt": "the food", "response": "great"},
    ]
    (ex, short), report = sft_examples(rows, tok, data)
    # The prompt keeps its last 4 tokens (data.too_long), then left truncation drops one more.
    assert ex.ids == ids(tok, "the food : great food") + [tok.eos_token_id]
    assert short.ids == ids(tok, "the food great") + [tok.eos_token_id]
    assert (report.truncated, report.cut) == (1, 1)
    summary = report.summary("sft data")
    assert "1 prompts truncated to their last tokens, 1 truncated to data.max_length" in summary


# --------------------------------------------------------------------------------- pairs


def test_pairs_are_cut_alike(toks):
    tok = toks["llama3"]
    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    row = {"prompt": PROMPT, "chosen": "great", "rejected": "the food was very bland"}
    # chosen 6 + 1 + EOS = 8 tokens, rejected 6 + 5 + EOS = 12

    (pair,), report = preference_pairs([row], tok, cfg("left", 10))
    # The same two prompt tokens leave both: one prompt, the longer sequence at the limit.
    assert pair.chosen == ids(tok, bos, "the food :", "great", eos)
    assert pair.rejected == ids(tok, bos, "the food :", "the food was very bland", eos)
    assert pair.prompt_len == 4 and report.cut == 1

    (pair,), report = preference_pairs([row], tok, cfg("right", 10))
    assert pair.chosen == ids(tok, bos, PROMPT, "great", eos)  # within the limit: whole
    assert pair.rejected == ids(tok, bos, PROMPT, "the food was very")
    assert pair.prompt_len == 6 and report.cut == 1

    pairs, report = preference_pairs([row], tok, cfg("none", 10))
    assert pairs == [] and dict(report.skipped) == {"longer than data.max_length": 1}


def test_pairs_equal_after_truncation_are_skipped(toks):
    tok = toks["llama3"]
    row = {
        "prompt": PROMPT,
        "chosen": "the food was very great",
        "rejected": "the food was very bland",
    }
    pairs, report = preference_pairs([row], tok, cfg("right", 10))
    assert pairs == [] and dict(report.skipped) == {"chosen == rejected after truncation": 1}


def test_ranked_list_pairs_are_cut_one_by_one(toks):
    tok = toks["chatml"]
    row = {"prompt": PROMPT, "responses": ["great", "the food was bland", "awful"]}
    pairs, report = preference_pairs([row], tok, cfg("left", 8))
    # (great, bland) and (bland, awful) are 10 long: two prompt tokens go; (great, awful) fits.
    assert [p.prompt_len for p in pairs] == [3, 5, 3] and report.cut == 2
    assert all(max(len(p.chosen), len(p.rejected)) <= 8 for p in pairs)


def test_kto_completion_stays_whole_with_left(toks):
    tok = toks["llama3"]
    kto = type("KTO", (), {"completion_field": "completion", "label_field": "label",
                           "responses_field": "responses"})()  # fmt: skip
    row = {"prompt": PROMPT, "completion": "great food", "label": True}
    (ex,), report = kto_examples([row], tok, cfg("left", 7), kto)
    assert ex.prompt == ids(tok, "<|begin_of_text|> the food :")
    assert ex.completion == ids(tok, "great food <|end_of_text|>") and report.cut == 1


# ------------------------------------------------------------------------ conversations


def conversation(*turns: tuple[str, str]) -> list[dict]:
    return [{"role": role, "content": text} for role, text in turns]


def test_conversational_left_drops_whole_earlier_turns(toks):
    tok = toks["chatml"]
    prompt = conversation(
        ("system", "review"), ("user", "the food"), ("assistant", "great"), ("user", PROMPT)
    )
    row = {"prompt": prompt, "completion": [assistant("great food")]}
    whole = chatml("system", "review") + chatml("user", "the food") + chatml("assistant", "great")
    tail = chatml("user", PROMPT) + chatml("assistant", "", close=False)
    full = len(whole) + len(tail) + 3  # "great food <|im_end|>"
    (ex,), _ = sft_examples([row], tok, cfg("none", full))
    assert ex.ids == ids(tok, *whole, *tail, "great food <|im_end|>")

    (ex,), report = sft_examples([row], tok, cfg("left", full - 1))
    # The first exchange (user "the food", assistant "great") goes whole; the system stays.
    head = chatml("system", "review") + tail
    assert ex.ids == ids(tok, *head, "great food <|im_end|>")
    assert ex.targets() == [False] * len(head) + [True] * 3 and report.cut == 1

    # Nothing left to drop but the turn being answered: a counted skip.
    examples, report = sft_examples([row], tok, cfg("left", len(head) + 2))
    assert examples == []
    assert dict(report.skipped) == {"longer than data.max_length with only its last user turn": 1}


def test_conversational_right_cuts_inside_the_response_only(toks):
    tok = toks["chatml"]
    row = {"prompt": [user(PROMPT)], "completion": [assistant("the food was very bland")]}
    head = chatml("user", PROMPT) + chatml("assistant", "", close=False)  # 10 tokens
    (ex,), report = sft_examples([row], tok, cfg("right", len(head) + 3))
    # The template's text of the prompt is whole; the response loses its end and <|im_end|>.
    assert ex.ids == ids(tok, *head, "the food was")
    assert ex.targets() == [False] * len(head) + [True] * 3 and report.cut == 1
    examples, report = sft_examples([row], tok, cfg("right", len(head)))
    assert examples == [] and dict(report.skipped) == {"prompt alone fills data.max_length": 1}


def test_messages_rows_left_keep_the_last_exchange(toks):
    tok = toks["chatml"]
    msgs = conversation(
        ("system", "review"), ("user", "the food"), ("assistant", "great"),
        ("user", PROMPT), ("assistant", "awful"),
    )  # fmt: skip
    (whole,), _ = sft_examples([{"messages": msgs}], tok, cfg("none", 64))
    (ex,), report = sft_examples([{"messages": msgs}], tok, cfg("left", len(whole.ids) - 1))
    want = chatml("system", "review") + chatml("user", PROMPT) + chatml("assistant", "awful")
    assert ex.ids == ids(tok, *want) and report.cut == 1
    assert sum(ex.targets()) == 2  # "awful <|im_end|>": the dropped answer left the loss too


def test_conversational_pairs_keep_one_prompt(toks):
    tok = toks["chatml"]
    shared = conversation(("user", "the food"), ("assistant", "great"), ("user", PROMPT))
    row = {"chosen": [*shared, assistant("great")], "rejected": [*shared, assistant("awful food")]}
    (whole,), _ = preference_pairs([row], tok, cfg("none", 64))
    (pair,), report = preference_pairs([row], tok, cfg("left", len(whole.rejected) - 1))
    head = chatml("user", PROMPT) + chatml("assistant", "", close=False)
    assert pair.chosen == ids(tok, *head, "great <|im_end|>")
    assert pair.rejected == ids(tok, *head, "awful food <|im_end|>")
    assert pair.prompt_len == len(head) and report.cut == 1
