"""data.truncate on SmolLM2's real tokenizer and chat template as they ship (docs/data.md):
left truncation of a conversation drops whole earlier turns and renders the rest through
the template again (which writes its default system turn again), right truncation cuts
inside the response only; a text row keeps its response whole under left truncation."""

from __future__ import annotations

from rlhf_dist.config import DataConfig
from rlhf_dist.data.rows import preference_pairs, sft_examples

EOS = 2  # <|im_end|>: SmolLM2's EOS and its template's end-of-turn token


def turns(*pairs: tuple[str, str]) -> list[dict]:
    return [{"role": role, "content": text} for role, text in pairs]


def data(truncate: str, max_length: int) -> DataConfig:
    return DataConfig(max_prompt_length=512, max_length=max_length, truncate=truncate)


EARLIER = turns(("user", "What is a good soup for winter?"), ("assistant", "Lentil soup."))
LAST = turns(("user", "And a dessert to follow it?"))
ANSWER = turns(("assistant", "A baked apple with cinnamon and a spoon of cream."))


def test_left_drops_the_earlier_exchange_and_renders_the_rest(real_tokenizers):
    tok = real_tokenizers["shipped"]
    row = {"prompt": EARLIER + LAST, "completion": ANSWER}
    (whole,), _ = sft_examples([row], tok, data("none", 512))
    (short,), _ = sft_examples([{"prompt": LAST, "completion": ANSWER}], tok, data("none", 512))
    assert len(short.ids) < len(whole.ids)
    (ex,), report = sft_examples([row], tok, data("left", len(whole.ids) - 1))
    # Exactly the conversation without its first exchange, as the template renders it.
    assert ex.ids == short.ids and ex.targets() == short.targets() and report.cut == 1
    assert "Lentil" not in tok.decode(ex.ids) and "SmolLM" in tok.decode(ex.ids)
    assert ex.ids[-1] == EOS  # the answer is whole, its end-of-turn included


def test_right_cuts_inside_the_answer(real_tokenizers):
    tok = real_tokenizers["shipped"]
    row = {"prompt": LAST, "completion": ANSWER}
    (whole,), _ = sft_examples([row], tok, data("none", 512))
    limit = whole.prompt_len + 4
    (ex,), report = sft_examples([row], tok, data("right", limit))
    assert ex.ids == whole.ids[:limit] and ex.prompt_len == whole.prompt_len
    assert sum(ex.targets()) == 4 and EOS not in ex.ids[whole.prompt_len :]
    assert tok.decode(ex.ids[ex.prompt_len :]).strip().startswith("A baked")
    assert report.cut == 1


def test_conversational_pair_left_keeps_one_prompt(real_tokenizers):
    tok = real_tokenizers["shipped"]
    worse = turns(("assistant", "Nothing."))
    row = {"chosen": EARLIER + LAST + ANSWER, "rejected": EARLIER + LAST + worse}
    (whole,), _ = preference_pairs([row], tok, data("none", 512))
    (pair,), report = preference_pairs([row], tok, data("left", len(whole.chosen) - 1))
    short = {"chosen": LAST + ANSWER, "rejected": LAST + worse}
    (expected,), _ = preference_pairs([short], tok, data("none", 512))
    assert (pair.chosen, pair.rejected) == (expected.chosen, expected.rejected)
    assert pair.prompt_len == expected.prompt_len and report.cut == 1


def test_text_row_left_keeps_the_response(real_tokenizers):
    tok = real_tokenizers["shipped"]  # SmolLM2 adds no BOS to text
    row = {"prompt": "Name a soup that is good in winter, please.", "response": "Lentil soup."}
    (whole,), _ = sft_examples([row], tok, data("none", 512))
    (ex,), _ = sft_examples([row], tok, data("left", len(whole.ids) - 3))
    assert ex.ids == whole.ids[3:] and ex.prompt_len == whole.prompt_len - 3
    assert ex.ids[ex.prompt_len :] == whole.ids[whole.prompt_len :]  # the response, EOS last
