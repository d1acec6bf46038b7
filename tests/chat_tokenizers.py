"""Chat tokenizers over the demo task's words, for the tests of conversational data and of a
reward model with its own tokenizer (moved from rlhf_dist/demo/task.py: only tests use them).
"""

from __future__ import annotations

from pathlib import Path

from rlhf_dist.demo.task import all_words

# Two chat "styles" of the task's words, for tests and users of conversational data: each
# a word-level tokenizer with a chat template, with different vocabularies (ids) and
# different templates, so a policy and a reward model can disagree on both.
ROLE_WORDS = ("system", "user", "assistant")
CHAT_STYLES = {
    # ChatML (Qwen's layout): no BOS; <|im_end|> closes a turn; EOS is a separate token.
    "chatml": {
        "specials": ("<pad>", "<eos>", "<unk>", "<|im_start|>", "<|im_end|>"),
        "tokens": {"pad_token": "<pad>", "eos_token": "<eos>", "unk_token": "<unk>"},
        "adds_bos": False,
        "template": (
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
        ),
    },
    # Llama 3's layout: the template starts with BOS AND the tokenizer adds BOS to every
    # encoding (its post-processor), the classic double-BOS trap; <|eot_id|> closes a turn.
    "llama3": {
        "specials": (
            "<|end_of_text|>",
            "<|pad|>",
            "<|begin_of_text|>",
            "<unk>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
        ),  # fmt: skip
        "tokens": {
            "pad_token": "<|pad|>",
            "eos_token": "<|end_of_text|>",
            "bos_token": "<|begin_of_text|>",
            "unk_token": "<unk>",
        },
        "adds_bos": True,
        "template": (
            "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
            "<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
            "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
            "{% endif %}"
        ),
    },
}


def build_chat_tokenizer(save_dir: str | Path, style: str):
    """A word-level tokenizer over the task's words and the role names, with the chat
    template of `style` (CHAT_STYLES), saved in HF format to `save_dir`.

    Ids: the style's special tokens first, then the words, sorted for "chatml" and in
    reverse order for "llama3", so the same word has different ids in the two.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    spec = CHAT_STYLES[style]
    words = sorted({*all_words(), *ROLE_WORDS}, reverse=style == "llama3")
    vocab = {tok: i for i, tok in enumerate((*spec["specials"], *words))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(list(spec["specials"]))
    if spec["adds_bos"]:
        bos = spec["tokens"]["bos_token"]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, vocab[bos])]
        )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        padding_side="right",
        clean_up_tokenization_spaces=False,
        model_max_length=128,
        **spec["tokens"],
    )
    tokenizer.chat_template = spec["template"]
    Path(save_dir).mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(save_dir))
    return tokenizer
