"""Conversations: checking message lists, rendering them with a chat template, which
tokens of a rendered conversation are the assistant's, and the ids that end a response.

A conversational row holds lists of messages `[{"role": ..., "content": ...}]` (TRL's
names). They are rendered to text with the tokenizer's chat template
(`apply_chat_template`) or `data.chat_template`, then tokenised WITHOUT the tokenizer's
own special tokens: the template writes the BOS (and every other marker) it wants, so a
BOS is never added twice (docs/data.md).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlhf_dist.config import DataConfig
from rlhf_dist.errors import ConfigError

if TYPE_CHECKING:  # transformers loads only where a model or tokenizer does
    from transformers import PreTrainedTokenizerBase

ROLES = ("system", "user", "assistant", "tool")
# The tool Chat.shows_tools renders a conversation with (an OpenAI function schema).
PROBE_TOOL_NAME = "rlhf_dist_probe_tool"
PROBE_TOOL: dict = {
    "type": "function",
    "function": {
        "name": PROBE_TOOL_NAME,
        "description": "A probe: is this tool shown to the model?",
        "parameters": {"type": "object", "properties": {}},
    },
}


class BadRow(Exception):
    """A data row that cannot be used; its message is the skip reason the report counts."""


def check_messages(value: Any, name: str) -> list[dict]:
    """`value` as a list of {role, content} messages, or BadRow with the reason."""
    if not isinstance(value, list) or not value:
        raise BadRow(f"'{name}' not a list of messages")
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise BadRow(f"'{name}' not a list of messages")
        if m.get("role") not in ROLES:
            raise BadRow(f"unknown role in '{name}'")
        if not m["content"].strip():
            raise BadRow(f"empty content in '{name}'")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def check_prompt_turns(messages: list[dict], name: str) -> list[dict]:
    """A prompt must end with the user's turn: the model answers it."""
    if messages[-1]["role"] != "user":
        raise BadRow(f"last turn of '{name}' not from the user")
    return messages


def prompt_text(prompt: str | list[dict]) -> str:
    """A prompt for people and judges to read (samples tables, judge templates): a text as
    is, a conversation as one "role: content" line per turn."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m['role']}: {m['content']}" for m in prompt)


# ChatML with Hermes/Qwen-style tools, for tokenizers whose own template shows no tools
# (SmolLM2's, Llama 2's): data.chat_template: chatml_tools. The tools' schemas go into a
# system turn; an assistant turn's OpenAI `tool_calls` are written as the <tool_call> blocks
# the policy itself emits (its content may be None then: the turn only called); tool
# results are turns of role "tool". Without tools and calls it renders plain ChatML.
CHATML_TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t | tojson }}{{ '\\n' }}"
    '{% endfor %}Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>'
    "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% for c in m.get('tool_calls') or [] %}{% set a = c['function']['arguments'] %}"
    "<tool_call>{\"name\": {{ c['function']['name'] | tojson }}, \"arguments\": "
    "{% if a is string %}{{ a }}{% else %}{{ a | tojson }}{% endif %}}</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
NAMED_TEMPLATES = {"chatml_tools": CHATML_TOOLS_TEMPLATE}


def resolve_template(tokenizer: PreTrainedTokenizerBase, chat_template: str, where: str) -> str:
    """The chat template to render with: `chat_template` (data.chat_template: a name in
    NAMED_TEMPLATES, a Jinja string or a file holding one), else the tokenizer's own; none
    is a ConfigError."""
    if chat_template:
        if chat_template in NAMED_TEMPLATES:
            return NAMED_TEMPLATES[chat_template]
        path = Path(chat_template).expanduser()
        if "{" not in chat_template and path.is_file():
            return path.read_text(encoding="utf-8")
        if "{{" in chat_template or "{%" in chat_template:
            return chat_template
        raise ConfigError(
            f"data.chat_template: {chat_template!r} is neither a file, a Jinja template "
            f"nor a template's name ({', '.join(NAMED_TEMPLATES)})"
        )
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.chat_template
    raise ConfigError(
        f"{where} holds conversational rows but the tokenizer "
        f"{getattr(tokenizer, 'name_or_path', '')!r} has no chat template: set "
        "data.chat_template (a Jinja string or a file path)"
    )


@dataclass(frozen=True)
class Chat:
    """A tokenizer and the chat template its conversations are rendered with, and the
    JSON schemas of the tools the template shows (multi-turn rollouts; none otherwise)."""

    tokenizer: PreTrainedTokenizerBase
    template: str
    tools: tuple[dict, ...] = ()

    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        """The template's text of `messages`; with `generation_prompt`, followed by the
        opening of the assistant's turn. A template that refuses the row: BadRow."""
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tools=list(self.tools) or None,
                chat_template=self.template,
                tokenize=False,
                add_generation_prompt=generation_prompt,
            )
        except Exception as e:  # jinja2's raise_exception and template bugs alike
            raise BadRow(f"chat template refused the row ({type(e).__name__})") from None

    def shows_tools(self) -> bool:
        """Whether the template writes the tools' schemas into the prompt: a probe tool's
        name must appear in a rendered one-turn conversation. SmolLM2's template, for one,
        ignores `tools`, so the policy would never learn what it may call. A template that
        refuses the probe conversation is given the benefit of the doubt."""
        probe = dataclasses.replace(self, tools=(PROBE_TOOL,))
        try:
            text = probe.render([{"role": "user", "content": "hello"}], generation_prompt=True)
        except BadRow:
            return True
        return PROBE_TOOL_NAME in text

    def encode(self, text: str) -> list[int]:
        """Ids of rendered text, no special tokens added: the template wrote them."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The prompt as the model continues it: rendered, with the generation prompt."""
        return self.encode(self.render(messages, generation_prompt=True))

    def conversation(
        self, messages: list[dict], first_trained: int = 0
    ) -> tuple[list[int], list[bool]]:
        """(ids, trained) of a whole conversation: `trained[t]` is True on the tokens of
        assistant turns at index >= `first_trained`, from the end of the generation prompt
        that opens the turn to the end of the turn's text (its end-of-turn marker
        included, whitespace after it not). The text is cut after its last non-space
        character, as a generated response ends at its stop token."""
        full = self.render(messages, generation_prompt=False).rstrip()
        spans = [
            self._turn_span(messages, i, full)
            for i in range(first_trained, len(messages))
            if messages[i]["role"] == "assistant"
        ]
        try:
            enc = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        except NotImplementedError:
            raise ConfigError(
                "model.tokenizer: conversational data needs a fast tokenizer (offsets)"
            ) from None
        trained = [any(a <= start < b for a, b in spans) for start, _ in enc["offset_mapping"]]
        return enc["input_ids"], trained

    def _turn_span(self, messages: list[dict], i: int, full: str) -> tuple[int, int]:
        """Character span in `full` of assistant turn i (after its generation prompt)."""
        opened = self.render(messages[:i], generation_prompt=True)
        closed = self.render(messages[: i + 1], generation_prompt=False).rstrip()
        if not (full.startswith(opened) and full.startswith(closed)):
            raise BadRow("chat template does not render earlier turns as a prefix")
        return len(opened), len(closed)

    def end_of_turn_id(self) -> int | None:
        """The special token the template closes an assistant turn with (Llama 3's
        <|eot_id|>, ChatML's <|im_end|>): the last token of a rendered assistant turn, if
        that token is a special added token. None if the template closes turns with text."""
        probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
        try:
            ids, trained = self.conversation(probe)
        except BadRow:  # a template with its own rules about turns: no token found
            return None
        turn = [t for t, keep in zip(ids, trained) if keep]
        special = {i for i, t in self.tokenizer.added_tokens_decoder.items() if t.special} - {
            self.tokenizer.unk_token_id
        }
        return turn[-1] if turn and turn[-1] in special else None


def chat_for(tokenizer: PreTrainedTokenizerBase, data_cfg: DataConfig, where: str) -> Chat:
    """The Chat conversational rows of `where` are rendered with (data.chat_template or the
    tokenizer's own template)."""
    return Chat(tokenizer, resolve_template(tokenizer, data_cfg.chat_template, where))


def export_tokenizer(
    tokenizer: PreTrainedTokenizerBase, data_cfg: DataConfig
) -> PreTrainedTokenizerBase:
    """The tokenizer an exported model is saved with: the run's own, as it shipped. When
    data.chat_template is set, a copy carrying it as its own template, so the next stage
    (rm or ppo after sft) renders conversations as this one did with no extra config; when
    the tokenizer shipped without PAD (models.load_tokenizer pads with EOS), a copy without
    it again. The run's tokenizer is untouched: it may still be compared with a reward
    model's (scoring.same_tokenizer)."""
    pad_from_eos = getattr(tokenizer, "rlhf_dist_pad_from_eos", False)
    if not data_cfg.chat_template and not pad_from_eos:
        return tokenizer
    out = copy.deepcopy(tokenizer)
    if data_cfg.chat_template:
        out.chat_template = resolve_template(
            tokenizer, data_cfg.chat_template, "data.chat_template"
        )
    if pad_from_eos:
        out.pad_token = None
        out.rlhf_dist_pad_from_eos = False
    return out


def stop_token_ids(
    tokenizer: PreTrainedTokenizerBase,
    chat: Chat | None,
    extra: Iterable[int] = (),
    generation_eos: int | Iterable[int] = (),
) -> tuple[int, ...]:
    """Every id that ends a response, sorted: the tokenizer's EOS, the model's
    generation_config.eos_token_id (`generation_eos`, an int or a list), the template's
    end-of-turn token and `extra` (generation.stop_token_ids). PAD may be one of them
    (SmolLM2 ships PAD == EOS): padding is marked by masks, never found by its id."""
    if isinstance(generation_eos, int):
        generation_eos = (generation_eos,)
    ids = {tokenizer.eos_token_id, *generation_eos, *extra}
    if chat is not None and (eot := chat.end_of_turn_id()) is not None:
        ids.add(eot)
    too_big = [i for i in ids if not 0 <= i < len(tokenizer)]
    if too_big:
        raise ConfigError(f"generation.stop_token_ids: {too_big[0]} is not in the vocabulary")
    return tuple(sorted(ids))


def is_stop(ids: torch.Tensor, stop_ids: int | Sequence[int]) -> torch.Tensor:
    """Bool tensor shaped like `ids`: the token is one of `stop_ids` (an id or a sequence
    of ids: EOS, the template's end-of-turn token, generation.stop_token_ids)."""
    stops = torch.as_tensor(stop_ids, dtype=ids.dtype, device=ids.device).reshape(-1)
    return (ids.unsqueeze(-1) == stops).any(-1)  # (..., S) compared, then any over S
