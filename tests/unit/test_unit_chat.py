"""Conversational data (rlhf_dist.chat and the conversational paths of rlhf_dist.data).

Two word-level chat tokenizers from the demo task (tests/chat_tokenizers.py, CHAT_STYLES) with
different vocabularies and templates: "chatml" (no BOS, <|im_end|> closes a turn, EOS a
separate token) and "llama3" (the template writes BOS and the tokenizer adds one too,
<|eot_id|> closes a turn). Words are single tokens and whitespace vanishes, so every
expected id sequence below is written out by hand from the template's text.
"""

import json

import pytest
from chat_tokenizers import build_chat_tokenizer
from transformers import AutoTokenizer

from rlhf_dist.config import ConfigError, DataConfig
from rlhf_dist.data.chat import (
    CHATML_TOOLS_TEMPLATE,
    BadRow,
    Chat,
    chat_for,
    check_messages,
    export_tokenizer,
    resolve_template,
    stop_token_ids,
)
from rlhf_dist.data.rows import (
    SFTExample,
    close_with_stop,
    collate_sft,
    is_conversational,
    load_rows,
    preference_pairs,
    prompt_set,
    sft_examples,
    split_implicit_prompt,
)
from rlhf_dist.demo.task import build_tokenizer

CFG = DataConfig(max_prompt_length=32, max_length=64)


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_toks")
    return {style: build_chat_tokenizer(root / style, style) for style in ("chatml", "llama3")}


def ids(tok, *tokens: str) -> list[int]:
    """Ids of space-separated words and special tokens, looked up one by one."""
    vocab = tok.get_vocab()
    return [vocab[t] for text in tokens for t in text.split()]


def chatml(role: str, text: str, close: bool = True) -> list[str]:
    """The tokens of one ChatML turn (one word or marker each)."""
    return ["<|im_start|>", role, *text.split()] + (["<|im_end|>"] if close else [])


def llama3(role: str, text: str, close: bool = True) -> list[str]:
    """The tokens of one Llama-3 turn (one word or marker each)."""
    head = ["<|start_header_id|>", role, "<|end_header_id|>", *text.split()]
    return head + (["<|eot_id|>"] if close else [])


# ------------------------------------------------------------------------- messages


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("hello", "'prompt' not a list of messages"),
        ([], "'prompt' not a list of messages"),
        ([{"role": "user"}], "'prompt' not a list of messages"),
        ([{"role": "user", "content": 3}], "'prompt' not a list of messages"),
        ([{"role": "critic", "content": "hi"}], "unknown role in 'prompt'"),
        ([{"role": "user", "content": "  "}], "empty content in 'prompt'"),
    ],
)
def test_bad_messages_name_their_reason(value, reason):
    with pytest.raises(BadRow) as info:
        check_messages(value, "prompt")
    assert str(info.value) == reason


def test_messages_keep_role_and_content_only():
    msgs = [{"role": "user", "content": "hi", "name": "x"}]
    assert check_messages(msgs, "prompt") == [{"role": "user", "content": "hi"}]


def test_is_conversational_looks_at_the_first_value_present():
    assert is_conversational([{"prompt": None}, {"prompt": [user("a")]}], ("prompt",))
    assert not is_conversational([{"prompt": "a"}, {"prompt": [user("a")]}], ("prompt",))
    assert not is_conversational([{"other": 1}], ("prompt",))


# ------------------------------------------------------------------------ templates


def test_template_from_key_string_file_or_tokenizer(tmp_path, toks):
    plain = build_tokenizer(tmp_path / "plain")  # no chat template
    jinja = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    assert resolve_template(plain, jinja, "data.train 'x'") == jinja
    path = tmp_path / "t.jinja"
    path.write_text(jinja)
    assert resolve_template(plain, str(path), "data.train 'x'") == jinja
    assert resolve_template(toks["chatml"], "", "w") == toks["chatml"].chat_template
    assert resolve_template(plain, "chatml_tools", "w") == CHATML_TOOLS_TEMPLATE
    with pytest.raises(ConfigError, match=r"^data\.chat_template: .*neither a file.*chatml_tools"):
        resolve_template(plain, "no_such_file.jinja", "data.train 'x'")


LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}


def test_shows_tools_tells_a_template_that_writes_the_schemas_from_one_that_ignores_them(toks):
    tok = toks["chatml"]
    ignores = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{% endfor %}"
    names_only = "{% for t in tools %}{{ t['function']['name'] }}{% endfor %}" + ignores
    refuses = "{{ raise_exception('no') }}"
    assert Chat(tok, CHATML_TOOLS_TEMPLATE).shows_tools()
    assert Chat(tok, names_only).shows_tools()
    assert not Chat(tok, ignores).shows_tools()
    assert Chat(tok, refuses).shows_tools()  # cannot tell: not refused for it


def test_chatml_tools_writes_openai_tool_calls_as_the_blocks_the_policy_emits(toks):
    """An assistant turn that only called (content None, as OpenAI clients send it back) and
    one with text too; arguments as a JSON string (OpenAI's wire format) or a dict."""
    chat = Chat(toks["chatml"], CHATML_TOOLS_TEMPLATE, tools=(LOOKUP,))
    call = {"id": "c1", "type": "function", "function": {"name": "lookup"}}
    messages = [
        user("code of river ?"),
        {"role": "assistant", "content": None,
         "tool_calls": [{**call, "function": {**call["function"], "arguments": '{"key": "river"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "assistant", "content": "again",
         "tool_calls": [{**call, "function": {**call["function"], "arguments": {"key": "sea"}}}]},
    ]  # fmt: skip
    text = chat.render(messages, generation_prompt=False)
    assert text.startswith('<|im_start|>system\nTools:\n{"type": "function"')
    assert (
        '<|im_start|>assistant\n<tool_call>{"name": "lookup", "arguments": {"key": "river"}}'
        "</tool_call><|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\nagain"
        '<tool_call>{"name": "lookup", "arguments": {"key": "sea"}}</tool_call><|im_end|>'
    ) in text
    plain = Chat(toks["chatml"], CHATML_TOOLS_TEMPLATE).render([user("hi")], True)
    assert plain == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_missing_template_is_one_line_naming_file_and_key(tmp_path):
    plain = build_tokenizer(tmp_path / "plain")
    rows = [{"prompt": [user("review of the food :")]}]
    with pytest.raises(ConfigError) as info:
        prompt_set(rows, plain, CFG, "data.train 'chats.jsonl'")
    text = str(info.value)
    assert text.startswith("data.train 'chats.jsonl' holds conversational rows")
    assert "data.chat_template" in text and "\n" not in text


def test_data_chat_template_is_used_for_a_plain_tokenizer(tmp_path):
    plain = build_tokenizer(tmp_path / "plain")
    cfg = DataConfig(chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}")
    ps = prompt_set([{"prompt": [user("review of the food :")]}], plain, cfg)
    vocab = plain.get_vocab()
    assert ps.ids == [[vocab[w] for w in ["review", "of", "the", "food", ":"]]]


def test_exported_tokenizer_carries_data_chat_template(tmp_path, toks):
    plain = build_tokenizer(tmp_path / "plain")  # no chat template
    jinja = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    path = tmp_path / "t.jinja"
    path.write_text(jinja)
    for given in (jinja, str(path)):
        exported = export_tokenizer(plain, DataConfig(chat_template=given))
        exported.save_pretrained(tmp_path / "out")
        assert AutoTokenizer.from_pretrained(tmp_path / "out").chat_template == jinja
    assert not plain.chat_template  # the run's own tokenizer is left as loaded
    # Without the key the tokenizer is saved as it came, its own template included.
    assert export_tokenizer(toks["chatml"], CFG) is toks["chatml"]


@pytest.mark.parametrize("style", ["chatml", "llama3"])
def test_conversational_prompt_ids_and_a_single_bos(toks, style):
    tok = toks[style]
    msgs = [user("review of the food :")]
    ps = prompt_set([{"prompt": msgs}], tok, CFG)
    if style == "chatml":
        want = chatml("user", "review of the food :") + chatml("assistant", "", close=False)
    else:
        # The template writes BOS; the tokenizer's own BOS must not be added again.
        want = ["<|begin_of_text|>"]
        want += llama3("user", "review of the food :") + llama3("assistant", "", close=False)
        assert tok("food")["input_ids"][0] == tok.bos_token_id  # the trap is armed
    assert ps.ids == [ids(tok, *want)]
    assert ps.texts == [msgs]  # what a reward function receives
    assert ps.ids[0].count(tok.bos_token_id) == (style == "llama3")


def test_bad_prompt_rows_are_counted(toks):
    rows = [
        {"prompt": [user("review of the food :")]},
        {"prompt": [user("a"), assistant("great")]},  # last turn not from the user
        {"prompt": [{"role": "critic", "content": "a"}]},
        {"prompt": [user("")]},
        {"prompt": "review of the food :"},  # text in a conversational file
        {"other": 1},
        {"prompt": [user(" ".join(["food"] * 40))]},  # longer than 32 tokens
    ]
    ps = prompt_set(rows, toks["chatml"], CFG)
    assert ps.report.kept == 1
    assert dict(ps.report.skipped) == {
        "last turn of 'prompt' not from the user": 1,
        "unknown role in 'prompt'": 1,
        "empty content in 'prompt'": 1,
        "'prompt' not a list of messages": 1,
        "missing 'prompt'": 1,
        "conversational prompt too long": 1,
    }


# ------------------------------------------------------------------------------ SFT


def test_sft_messages_train_on_assistant_turns_only(toks):
    tok = toks["llama3"]
    msgs = [
        {"role": "system", "content": "review"},
        user("review of the food :"),
        assistant("great food"),
        user("and the hotel"),
        assistant("awful"),
    ]
    (ex,), report = sft_examples([{"messages": msgs}], tok, CFG)
    assert report.kept == 1
    parts = [
        (["<|begin_of_text|>"], False),
        (llama3("system", "review"), False),
        (llama3("user", "review of the food :"), False),
        (llama3("assistant", "", close=False), False),
        (["great", "food", "<|eot_id|>"], True),
        (llama3("user", "and the hotel"), False),
        (llama3("assistant", "", close=False), False),
        (["awful", "<|eot_id|>"], True),
    ]
    assert ex.ids == ids(tok, *[t for p, _ in parts for t in p])
    assert ex.targets() == [k for p, k in parts for _ in p]
    # Every token that is not the assistant's is out of the loss, in the collated batch too.
    batch = collate_sft([ex], tok.pad_token_id)
    assert batch["loss_mask"][0].tolist() == ex.targets()[1:]


def test_sft_prompt_completion_trains_the_completion_only(toks):
    tok = toks["chatml"]
    row = {
        "prompt": [user("a"), assistant("great"), user("the food")],
        "completion": [assistant("great")],
    }
    (ex,), _ = sft_examples([row], tok, CFG)
    head = chatml("user", "a") + chatml("assistant", "great") + chatml("user", "the food")
    head += chatml("assistant", "", close=False)
    assert ex.ids == ids(tok, *head, "great", "<|im_end|>")
    assert ex.targets() == [False] * len(head) + [True, True]
    assert ex.prompt_len == len(head)


def test_sft_text_prompt_completion_is_prompt_response(tmp_path):
    tok = build_tokenizer(tmp_path / "plain")
    (ex,), _ = sft_examples([{"prompt": "the food", "completion": "great"}], tok, CFG)
    vocab = tok.get_vocab()
    assert ex.ids == [vocab["the"], vocab["food"], vocab["great"], tok.eos_token_id]
    assert ex.prompt_len == 2


def test_bad_sft_conversations_are_counted(toks):
    rows = [
        {"messages": [user("a"), assistant("great")]},
        {"messages": [user("a"), user("b")]},  # nothing to learn
        {"messages": [user("a"), {"role": "bot", "content": "x"}]},
        {"messages": [user("a"), assistant(" ")]},
        {"messages": [user("a"), assistant(" ".join(["food"] * 70))]},
    ]
    examples, report = sft_examples(rows, toks["chatml"], CFG)
    assert len(examples) == report.kept == 1
    assert dict(report.skipped) == {
        "no assistant turn in 'messages'": 1,
        "unknown role in 'messages'": 1,
        "empty content in 'messages'": 1,
        "longer than data.max_length": 1,
    }


def test_a_template_without_end_of_turn_token_gets_eos(tmp_path):
    tok = build_tokenizer(tmp_path / "plain")
    cfg = DataConfig(chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}")
    (ex,), _ = sft_examples([{"messages": [user("the food"), assistant("great")]}], tok, cfg)
    vocab = tok.get_vocab()
    assert ex.ids == [vocab["the"], vocab["food"], vocab["great"], tok.eos_token_id]
    assert ex.targets() == [False, False, True, True]


def test_close_with_stop_by_hand():
    assert close_with_stop([5, 6], [False, True], (1, 9), 1) == ([5, 6, 1], [False, True, True])
    assert close_with_stop([5, 9], [False, True], (1, 9), 1) == ([5, 9], [False, True])


def test_collate_sft_with_trained_flags():
    batch = collate_sft(
        [SFTExample([7, 8, 9, 10], 1, [False, True, False, True]), SFTExample([7, 8], 1)], 0
    )
    assert batch["loss_mask"].tolist() == [[True, False, True], [True, False, False]]


# ---------------------------------------------------------------------- preferences


def test_implicit_prompt_is_the_shared_leading_turns():
    p = [user("a"), assistant("b"), user("c")]
    assert split_implicit_prompt(p + [assistant("x")], p + [assistant("y")]) == (
        p,
        [assistant("x")],
        [assistant("y")],
    )
    with pytest.raises(BadRow, match="different prompts"):
        split_implicit_prompt([user("a"), assistant("x")], [user("b"), assistant("y")])
    with pytest.raises(BadRow, match="chosen == rejected"):
        split_implicit_prompt(p + [assistant("x")], p + [assistant("x")])


@pytest.mark.parametrize("explicit", [True, False])
def test_conversational_pairs_render_whole_conversations(toks, explicit):
    tok = toks["chatml"]
    prompt = [user("review of the food :")]
    if explicit:
        row = {"prompt": prompt, "chosen": [assistant("great")], "rejected": [assistant("awful")]}
    else:
        row = {"chosen": prompt + [assistant("great")], "rejected": prompt + [assistant("awful")]}
    (pair,), report = preference_pairs([row], tok, CFG)
    head = chatml("user", "review of the food :") + chatml("assistant", "", close=False)
    assert pair.chosen == ids(tok, *head, "great", "<|im_end|>")
    assert pair.rejected == ids(tok, *head, "awful", "<|im_end|>")
    assert pair.prompt_len == len(head)


def test_bad_preference_conversations_are_counted(toks, tmp_path):
    p = [user("review of the food :")]
    rows = [
        {"chosen": p + [assistant("great")], "rejected": p + [assistant("awful")]},
        {"chosen": p + [assistant("great")], "rejected": [user("the hotel"), assistant("awful")]},
        {"chosen": p + [assistant("great")], "rejected": p + [assistant("great")]},
        {"chosen": p + [assistant("great")], "rejected": p + [{"role": "x", "content": "y"}]},
        {"prompt": p, "chosen": [user("great")], "rejected": [assistant("awful")]},
        {"prompt": [assistant("hi")], "chosen": [assistant("a")], "rejected": [assistant("b")]},
        {"chosen": p + [assistant("great")]},
    ]
    path = tmp_path / "prefs.jsonl"  # through `datasets`, which fills absent columns with None
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pairs, report = preference_pairs(load_rows(str(path), "data.train"), toks["llama3"], CFG)
    assert len(pairs) == report.kept == 1
    assert dict(report.skipped) == {
        "chosen and rejected have different prompts": 1,
        "chosen == rejected": 1,
        "unknown role in 'rejected'": 1,
        "'chosen' holds turns other than the assistant's": 1,
        "last turn of 'prompt' not from the user": 1,
        "missing 'rejected'": 1,
    }


# ---------------------------------------------------------------------- stop tokens


def test_end_of_turn_token_of_each_template(toks):
    for style, eot in (("chatml", "<|im_end|>"), ("llama3", "<|eot_id|>")):
        tok = toks[style]
        assert Chat(tok, tok.chat_template).end_of_turn_id() == tok.get_vocab()[eot]


def test_stop_token_ids_are_the_union(toks):
    tok = toks["chatml"]  # <eos> = 1, <|im_end|> = 4, <pad> = 0
    chat = chat_for(tok, DataConfig(), "w")
    assert stop_token_ids(tok, None) == (1,)
    assert stop_token_ids(tok, chat) == (1, 4)
    assert stop_token_ids(tok, chat, extra=(7,), generation_eos=[9, 1]) == (1, 4, 7, 9)
    assert stop_token_ids(tok, None, generation_eos=3) == (1, 3)
    # PAD may be a stop token (SmolLM2 ships PAD == EOS): padding is found by masks.
    assert stop_token_ids(tok, chat, extra=(0,)) == (0, 1, 4)
    with pytest.raises(ConfigError, match="not in the vocabulary"):
        stop_token_ids(tok, chat, extra=(10**6,))
