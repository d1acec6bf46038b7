"""Prompt, SFT and preference data: loading with `datasets`, tokenising, collating.

Data sources are local .jsonl/.json/.parquet/.csv files, hub dataset names, reasoning-gym
tasks (`reasoning_gym:TASK?...`, data/tasks.py) or a verifiers environment's dataset
(`verifiers:ENV_ID?...`, data/environments.py). Each file is
text or conversational, decided once per file from its rows (TRL's formats, docs/data.md):
conversational rows hold message lists and are rendered with a chat template
(rlhf_dist.data.chat). Rows a user got wrong (missing field, empty text, wrong type, unknown
role, too long) are skipped and counted with a reason; the counts are reported, never
silently dropped.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch

from rlhf_dist.algo.masking import last_token_index
from rlhf_dist.config import DataConfig, KTOConfig
from rlhf_dist.config.environments import is_environment_spec
from rlhf_dist.config.paths import LOCAL_BUILDERS, data_file_problem
from rlhf_dist.config.tasks import is_task_spec
from rlhf_dist.data import inputs, tasks
from rlhf_dist.data.chat import (
    BadRow,
    Chat,
    chat_for,
    check_messages,
    check_prompt_turns,
    stop_token_ids,
)
from rlhf_dist.data.environments import environment_rows
from rlhf_dist.data.vision import Media, VisionInputs, join_media
from rlhf_dist.errors import ConfigError

if TYPE_CHECKING:  # transformers loads only where a model or tokenizer does
    from transformers import PreTrainedTokenizerBase

T = TypeVar("T")
# (ids, trained) of one sequence: its token ids and, per token, whether the loss covers it.
Seq = tuple[list[int], list[bool]]
# A prompt or a response as a row gives it: a text, or a list of {role, content} messages.
Text = str | list[dict]


@dataclass
class SkipReport:
    """Counts of rows skipped, by reason."""

    kept: int = 0
    truncated: int = 0  # prompts cut to data.max_prompt_length
    cut: int = 0  # sequences (SFT, pairs, KTO) cut to data.max_length by data.truncate
    skipped: Counter[str] = field(default_factory=Counter)

    def skip(self, reason: str) -> None:
        self.skipped[reason] += 1

    def summary(self, what: str) -> str:
        """One line for the log: `what` kept, truncated, cut and skipped (by reason)."""
        text = f"{what}: {self.kept} kept"
        if self.truncated:
            text += f", {self.truncated} prompts truncated to their last tokens"
        if self.cut:
            text += f", {self.cut} truncated to data.max_length"
        if self.skipped:
            reasons = ", ".join(f"{n} {r}" for r, n in self.skipped.most_common())
            text += f", {sum(self.skipped.values())} skipped ({reasons})"
        return text


def load_data(d: DataConfig, which: str) -> list[dict]:
    """Rows of data.train or data.eval (`which`), a hub dataset read at data.subset and
    that key's split (data.split / data.eval_split). A reasoning-gym task in data.eval
    leaves out the questions of one in data.train (data/tasks.py)."""
    split = d.eval_split if which == "eval" else d.split
    source = getattr(d, which)
    if which == "eval" and is_task_spec(source) and is_task_spec(d.train):
        return tasks.task_rows(source, "data.eval", held_out_from=d.train)
    return load_rows(source, f"data.{which}", split, d.subset)


def load_rows(source: str, key: str, split: str = "train", subset: str = "") -> list[dict]:
    """Rows of a local data file (by extension), a hub dataset, a reasoning-gym task, or
    rows a Python caller gave (`python:` specs, rlhf_dist.data.inputs), as a list of dicts."""
    if inputs.is_python(source):
        return python_rows(inputs.lookup(source, key), key)
    if is_task_spec(source):
        return tasks.task_rows(source, key)
    if is_environment_spec(source):
        return environment_rows(source, key, "eval" if key == "data.eval" else "train")
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    path = Path(source).expanduser()
    try:
        if path.suffix in LOCAL_BUILDERS:
            problem = data_file_problem(source, key)  # missing or empty: one line
            if problem:
                raise ConfigError(problem)
            ds = datasets.load_dataset(
                LOCAL_BUILDERS[path.suffix], data_files=str(path), split="train"
            )
        elif path.exists():
            raise ConfigError(f"{key}: {source!r} is not a .jsonl/.json/.parquet/.csv file")
        else:
            ds = datasets.load_dataset(source, subset or None, split=split)
        return list(ds)  # inside the try: undecodable text only fails here
    except ConfigError:
        raise
    except Exception as e:  # datasets raises many types for unreadable/absent data
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"{key}: cannot load {source!r}: {first}") from None


def python_rows(given: Any, key: str) -> list[dict]:
    """A `datasets.Dataset` or a sequence of dicts given through the Python API, as rows."""
    rows = given.to_list() if hasattr(given, "to_list") else given
    if isinstance(rows, (str, bytes, dict)) or not hasattr(rows, "__iter__"):
        raise ConfigError(f"{key}: expected a datasets.Dataset or a list of dicts")
    rows = list(rows)
    if not rows:
        raise ConfigError(f"{key}: the dataset given has no rows")
    bad = next((r for r in rows if not isinstance(r, dict)), None)
    if bad is not None:
        raise ConfigError(f"{key}: rows must be dicts, got a {type(bad).__name__}")
    return rows


def _row_text(row: dict, name: str) -> str:
    """The text under `name`, or BadRow (missing, not text, blank)."""
    value = row.get(name)
    if value is None:
        raise BadRow(f"missing '{name}'")
    if not isinstance(value, str):
        raise BadRow(f"'{name}' not text")
    if not value.strip():
        raise BadRow(f"empty '{name}'")
    return value


def is_conversational(rows: list[dict], names: tuple[str, ...]) -> bool:
    """Whether a file's rows are conversational: the first value found under `names` (in
    row order) is a list. Decided once per file, so one odd row is a counted skip, not a
    second format."""
    for row in rows:
        for name in names:
            if row.get(name) is not None:
                return isinstance(row[name], list)
    return False


def _row_messages(row: dict, name: str) -> list[dict]:
    """The message list under `name`, or BadRow (missing, not messages, bad turn)."""
    if row.get(name) is None:
        raise BadRow(f"missing '{name}'")
    return check_messages(row[name], name)


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase, text: str, max_len: int, too_long: str, report: SkipReport
) -> list[int]:
    """Prompt token ids (BOS added if the tokenizer adds one); long prompts keep their end
    (counted in `report`), or are a BadRow with data.too_long=drop."""
    ids = tokenizer(text)["input_ids"]
    if len(ids) > max_len:
        if too_long == "drop":
            raise BadRow("prompt too long")
        report.truncated += 1
        ids = ids[-max_len:]
    return ids


def encode_response(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Response ids followed by EOS: the reward is read at the EOS token."""
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def close_with_stop(
    ids: list[int], trained: list[bool], stop_ids: Collection[int], eos_id: int
) -> Seq:
    """A conversation that does not end with a stop token (a template that closes turns
    with plain text) gets EOS appended and trained: every sequence must end at a token
    generation can stop at, where the reward is read."""
    if ids and ids[-1] in stop_ids:
        return ids, trained
    return ids + [eos_id], trained + [True]


def encode_each(
    rows: list[dict], encode: Callable[[dict, SkipReport], list[T]]
) -> tuple[list[T], SkipReport]:
    """Everything `encode(row, report)` makes of each row (a list per row). A BadRow skips
    its row, counted under its reason; `report` also counts skips within a row (one pair of
    a ranked list) and truncated prompts."""
    report = SkipReport()
    out: list[T] = []
    for row in rows:
        try:
            out += encode(row, report)
        except BadRow as e:
            report.skip(str(e))
    report.kept = len(out)
    return out, report


def with_images(
    vision: VisionInputs | None, row: dict, holders: Sequence[str], others: Sequence[str] = ()
) -> tuple[dict, list[Any]]:
    """(row, its images): a vision run's row with its images loaded and the message lists
    under `holders` (which hold the images) and `others` flattened (data/vision.py
    `VisionInputs.flat_row`; a bad image or count is BadRow); a text run's row as it is."""
    if vision is None:
        return row, []
    images = vision.images_of(row)
    return vision.flat_row(row, holders, others, images), images


def expand_images(
    vision: VisionInputs | None,
    ids: list[int],
    trained: list[bool],
    images: list,
    limit: tuple[str, int],
) -> tuple[list[int], list[bool], Media | None]:
    """(ids, trained, media) with each image placeholder replaced by its image's tokens
    (`VisionInputs.expand`); BadRow when those take the sequence past limit = (key, most
    tokens) (image tokens are never cut). A text run's sequence is returned as it is."""
    if vision is None:
        return ids, trained, None
    ids, trained, media = vision.expand(ids, trained, images)
    if len(ids) > limit[1]:
        raise BadRow(f"image tokens past {limit[0]}")
    return ids, trained, media


# ------------------------------------------------------------------- one row's tokens


@dataclass(frozen=True)
class RowRender:
    """How the rows of one file become token ids; SFT, preference and KTO rows all go
    through it (docs/data.md). Text (`chat` None): the prompt as the tokenizer encodes it
    by default, each response without special tokens, then EOS. Conversational: prompt +
    response turns rendered whole with `chat`, closed by a stop token (`stop_ids`)."""

    tokenizer: PreTrainedTokenizerBase
    data_cfg: DataConfig
    chat: Chat | None = None
    stop_ids: tuple[int, ...] = ()

    def prompt(self, row: dict) -> Text:
        """The row's prompt: a text, or messages ending with the user's turn; else BadRow."""
        name = self.data_cfg.prompt_field
        if self.chat is None:
            return _row_text(row, name)
        return check_prompt_turns(_row_messages(row, name), "prompt")

    def response(self, row: dict, name: str) -> Text:
        """A response column: a text, or assistant turns only; else BadRow."""
        if self.chat is None:
            return _row_text(row, name)
        turns = _row_messages(row, name)
        if any(m["role"] != "assistant" for m in turns):
            raise BadRow(f"'{name}' holds turns other than the assistant's")
        return turns

    def prompt_ids(self, prompt: Text, report: SkipReport) -> list[int]:
        """Ids of a prompt to generate from: a text per data.too_long; a conversation with
        its generation prompt, skipped when too long (cutting it would cut its template)."""
        cfg = self.data_cfg
        if self.chat is None:  # a text file's prompts are texts (self.prompt)
            return encode_prompt(
                self.tokenizer, cast(str, prompt), cfg.max_prompt_length, cfg.too_long, report
            )
        ids = self.chat.prompt_ids(cast("list[dict]", prompt))
        if len(ids) > cfg.max_prompt_length:
            raise BadRow("conversational prompt too long")
        return ids

    def sequences(self, prompt: Text, responses: Sequence[Text], report: SkipReport) -> list[Seq]:
        """(ids, trained) of prompt + each response: `trained` marks the response's tokens
        (its EOS included; for conversations its turns' tokens, chat.conversation). A text
        prompt is encoded once for all the responses."""
        if self.chat is not None:  # a conversational file's prompt and responses are turns
            turns = cast("list[dict]", prompt)
            return [self.conversation(turns + cast("list[dict]", r), len(turns)) for r in responses]
        p = self.prompt_ids(prompt, report)
        out = []
        for text in responses:
            r = encode_response(self.tokenizer, cast(str, text))
            out.append((p + r, [False] * len(p) + [True] * len(r)))
        return out

    def conversation(self, messages: list[dict], first_trained: int = 0) -> Seq:
        """(ids, trained) of a whole conversation, assistant turns from `first_trained` on
        trained, closed by a stop token (close_with_stop)."""
        assert self.chat is not None, "only a conversational file has conversations"
        ids, trained = self.chat.conversation(messages, first_trained)
        if not any(trained):
            raise BadRow("chat template renders no assistant tokens")
        return close_with_stop(ids, trained, self.stop_ids, self.tokenizer.eos_token_id)


def row_render(
    tokenizer: PreTrainedTokenizerBase, data_cfg: DataConfig, conversational: bool, where: str
) -> RowRender:
    """The RowRender of a file: text, or conversational with the chat template of
    data.chat_template or the tokenizer (`where` names the file in the error when neither)."""
    if not conversational:
        return RowRender(tokenizer, data_cfg)
    chat = chat_for(tokenizer, data_cfg, where)
    return RowRender(tokenizer, data_cfg, chat, stop_token_ids(tokenizer, chat))


# ------------------------------------------------------- data.max_length, data.truncate


class Unfit(Exception):
    """An item that data.truncate cannot bring within data.max_length; the skip reason."""


def fit_item(
    render: RowRender,
    seqs: list[Seq],
    report: SkipReport,
    turns: list[dict] | None = None,
    rerender: Callable[[list[dict]], list[Seq]] | None = None,
) -> list[Seq] | None:
    """One item's sequences ((ids, trained) each: an SFT or KTO sequence, or a pair) within
    data.max_length as data.truncate says, or None: a counted skip (docs/data.md). render:
    the file's RowRender.

    Cut alike, so a pair keeps one prompt: right cuts each at max_length; left drops the
    same leading prompt tokens from all (text) or re-renders them with whole earlier turns
    of the conversation `turns` dropped (`rerender(turns) -> seqs`)."""
    limit, mode = render.data_cfg.max_length, render.data_cfg.truncate
    if max(len(ids) for ids, _ in seqs) <= limit:
        return seqs
    try:
        if mode == "none":
            raise Unfit("longer than data.max_length")
        if mode == "right":
            out = [cut_right(seq, limit) for seq in seqs]
        elif turns is None:
            out = cut_left(seqs, limit, render.tokenizer.bos_token_id)
        else:
            assert rerender is not None, "a conversation's turns come with their rerender"
            out = drop_earlier_turns(turns, rerender, limit)
        if len(out) == 2 and out[0][0] == out[1][0]:
            raise Unfit("chosen == rejected after truncation")
    except Unfit as e:
        report.skip(str(e))
        return None
    report.cut += 1
    return out


def cut_right(seq: Seq, limit: int) -> Seq:
    """(ids, trained) cut to its first `limit` tokens and back to its last trained token:
    the response keeps its start and loses its end, its EOS or end-of-turn included."""
    ids, trained = seq[0][:limit], seq[1][:limit]
    if not any(trained):
        raise Unfit("prompt alone fills data.max_length")
    end = len(trained) - trained[::-1].index(True)
    return ids[:end], trained[:end]


def cut_left(seqs: list[Seq], limit: int, bos_id: int | None) -> list[Seq]:
    """Text sequences sharing one prompt, each without the same prompt tokens after the
    BOS (kept where the prompt starts with it), so the longest has `limit` tokens. At least
    one prompt token must remain: a response that leaves no room for one is a skip."""
    excess = max(len(ids) for ids, _ in seqs) - limit
    prompt_len = seqs[0][1].index(True)
    keep = 1 if bos_id is not None and seqs[0][0][:1] == [bos_id] else 0
    if prompt_len - keep - excess < 1:
        raise Unfit("response alone fills data.max_length")
    start = keep + excess
    return [(ids[:keep] + ids[start:], tr[:keep] + tr[start:]) for ids, tr in seqs]


def drop_earlier_turns(
    turns: list[dict], rerender: Callable[[list[dict]], list[Seq]], limit: int
) -> list[Seq]:
    """rerender(turns) with its first exchanges dropped, one at a time, until the item fits:
    cutting inside a rendered conversation would cut its template, so whole turns go
    (leading system messages stay). None left to drop: a skip."""
    shorter = drop_first_exchange(turns)
    while shorter is not None:
        seqs = rerender(shorter)
        if max(len(ids) for ids, _ in seqs) <= limit:
            return seqs
        shorter = drop_first_exchange(shorter)
    raise Unfit("longer than data.max_length with only its last user turn")


def drop_first_exchange(messages: list[dict]) -> list[dict] | None:
    """`messages` without what comes before their second user turn, leading system
    messages kept: the oldest exchange (a user turn, the answers and tool turns after it).
    None when fewer than two user turns are left (the last one is what is answered)."""
    start = 0
    while start < len(messages) and messages[start]["role"] == "system":
        start += 1
    users = [i for i in range(start, len(messages)) if messages[i]["role"] == "user"]
    if len(users) < 2:
        return None
    return messages[:start] + messages[users[1] :]


# ----------------------------------------------------------------------------- prompts


@dataclass
class PromptSet:
    """The usable prompts of a file, index-aligned, and the report of the rows skipped."""

    texts: list[Text]  # each prompt as the row gave it: a text, or a list of messages
    ids: list[list[int]]
    report: SkipReport
    # each prompt's row without its prompt column (an answer, a solution, a task's
    # metadata): what reward functions, judges and environments read beside the prompt
    columns: list[dict] = field(default_factory=list)
    # a vision run's pixel inputs of each prompt's images (data/vision.py; None: none);
    # [] for a text run
    media: list[Media | None] = field(default_factory=list)
    image_token_id: int | None = None  # a vision run's (VisionInputs.image_token_id)
    images: list[tuple[Any, ...]] = field(default_factory=list)  # each prompt's, decoded


def prompt_set(
    rows: list[dict],
    tokenizer: PreTrainedTokenizerBase,
    data_cfg: DataConfig,
    where: str = "data.train",
    vision: VisionInputs | None = None,
) -> PromptSet:
    """Prompts of a file: `prompt_field` as text, or as messages rendered with the chat
    template (`where` names the file in errors). With `vision` a prompt may hold images
    (docs/vision.md): its `image` / `images` columns are then the decoded PIL images, as
    TRL hands them to reward functions."""
    conversational = is_conversational(rows, (data_cfg.prompt_field,))
    chat = chat_for(tokenizer, data_cfg, where) if conversational else None
    render = RowRender(tokenizer, data_cfg, chat)  # prompts only: no stop ids needed
    name = data_cfg.prompt_field

    def encode(row: dict, report: SkipReport) -> list[tuple[Text, list[int], dict, Any, tuple]]:
        row, images = with_images(vision, row, (name,))
        prompt = render.prompt(row)
        others = {k: v for k, v in row.items() if k != name}
        if images:  # the decoded images, as TRL passes them
            many = row.get("images") is not None
            others |= {"images": images} if many else {"image": images[0]}
        ids = render.prompt_ids(prompt, report)
        limit = ("data.max_prompt_length", data_cfg.max_prompt_length)
        ids, _, media = expand_images(vision, ids, [False] * len(ids), images, limit)
        return [(prompt, ids, others, media, tuple(images))]

    found, report = encode_each(rows, encode)
    if not found:
        raise ConfigError(f"data: no usable prompts ({report.summary('prompts')})")
    texts, ids, columns, media, images = (list(x) for x in zip(*found))
    if vision is None:
        return PromptSet(texts, ids, report, columns)
    return PromptSet(texts, ids, report, columns, media, vision.image_token_id, images)


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded (B, P) ids and attention mask: generation continues from the right edge."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s) :] = torch.tensor(s)
            mask[i, width - len(s) :] = 1
    return ids, mask


def right_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (B, L) ids and attention mask."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids, mask


# --------------------------------------------------------------------------------- SFT


@dataclass
class SFTExample:
    """One SFT sequence. The loss covers tokens from `prompt_len` on, or, when `trained`
    is given (conversations), exactly the tokens where it is True."""

    ids: list[int]
    prompt_len: int
    trained: list[bool] | None = None
    media: Media | None = None  # pixel inputs of its images (data/vision.py), None: none

    def targets(self) -> list[bool]:
        """Per token of `ids`: does the loss predict it."""
        if self.trained is not None:
            return self.trained
        return [False] * self.prompt_len + [True] * (len(self.ids) - self.prompt_len)


def sft_format(
    rows: list[dict], data_cfg: DataConfig, response_field: str = "response"
) -> tuple[str, bool]:
    """(form, conversational) of an SFT file: form "messages" (whole conversations),
    "completion" (TRL's prompt + completion) or `response_field` (prompt + response)."""
    if any(row.get("messages") is not None for row in rows):
        return "messages", True
    form = "completion" if any(row.get("completion") is not None for row in rows) else None
    form = form or response_field
    return form, is_conversational(rows, (data_cfg.prompt_field, form))


def messages_sequence(render: RowRender, row: dict) -> Seq:
    """(ids, trained) of a `messages` row: the loss covers all its assistant turns."""
    messages = _row_messages(row, "messages")
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRow("no assistant turn in 'messages'")
    return render.conversation(messages)


def sft_examples(
    rows: list[dict],
    tokenizer: PreTrainedTokenizerBase,
    data_cfg: DataConfig,
    response_field: str = "response",
    where: str = "data.train",
    vision: VisionInputs | None = None,
) -> tuple[list[SFTExample], SkipReport]:
    """SFT sequences of a file (docs/data.md): prompt + response(+EOS) or prompt +
    completion as text, or conversations; the loss covers response tokens only. With
    `vision` (a vision-language policy) rows may hold images (docs/vision.md)."""
    form, conversational = sft_format(rows, data_cfg, response_field)
    render = row_render(tokenizer, data_cfg, conversational, where)
    holders = ("messages",) if form == "messages" else (data_cfg.prompt_field,)

    def encode(row: dict, report: SkipReport) -> list[SFTExample]:
        row, images = with_images(vision, row, holders, (form,))
        if form == "messages":
            seq = messages_sequence(render, row)
            turns: list[dict] | None = _row_messages(row, "messages")

            def rerender(messages: list[dict]) -> list[Seq]:
                return [render.conversation(messages)]
        else:
            prompt, response = render.prompt(row), render.response(row, form)
            seq = render.sequences(prompt, [response], report)[0]
            turns = cast("list[dict]", prompt) if conversational else None

            def rerender(messages: list[dict]) -> list[Seq]:
                return render.sequences(messages, [response], report)

        fitted = fit_item(render, [seq], report, turns, rerender)
        if fitted is None:
            return []
        limit = ("data.max_length", data_cfg.max_length)
        ids, trained, media = expand_images(vision, *fitted[0], images, limit)
        return [SFTExample(ids, trained.index(True), trained if conversational else None, media)]

    return encode_each(rows, encode)


# The text tensors of a `collate_sft` batch; any other key is a vision batch's pixel input.
SFT_KEYS = ("input_ids", "attention_mask", "loss_mask")


def collate_sft(batch: list[SFTExample], pad_id: int) -> dict[str, torch.Tensor]:
    """input_ids/attention_mask (B, L) and loss_mask (B, L-1): True where token t+1 is a
    response (assistant) token the logits at t must predict."""
    ids, attn = right_pad([ex.ids for ex in batch], pad_id)
    targets = torch.zeros(ids.shape, dtype=torch.bool)
    for b, ex in enumerate(batch):
        targets[b, : len(ex.ids)] = torch.tensor(ex.targets(), dtype=torch.bool)
    media = join_media([ex.media for ex in batch])  # a vision batch's pixel inputs
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": targets[:, 1:]} | media


# -------------------------------------------------------------------------- preferences


@dataclass
class PreferencePair:
    """Token ids of a preferred and a dispreferred sequence (prompt + response + EOS) of
    the same prompt; `category` is the row's, for per-category accuracy."""

    chosen: list[int]
    rejected: list[int]
    category: str | None = None
    prompt_len: int = 0  # tokens of the shared prompt at the start of both sequences
    media: Media | None = None  # pixel inputs of the prompt's images (data/vision.py)


def _text_pairs(row: dict, responses_field: str, report: SkipReport) -> list[tuple[str, str]]:
    """(chosen, rejected) texts of one text row: a pair, or all C(n,2) pairs of a ranked list."""
    # `datasets` fills absent columns with None, so a mixed file has chosen=None on ranked rows.
    if row.get(responses_field) is not None and row.get("chosen") is None:
        responses = row[responses_field]
        if not isinstance(responses, list) or len(responses) < 2:
            raise BadRow(f"'{responses_field}' not a list of 2+ texts")
        if not all(isinstance(r, str) and r.strip() for r in responses):
            raise BadRow(f"empty or non-text entry in '{responses_field}'")
        # Best-first ranking: every earlier response is preferred to every later one.
        pairs = []
        for better, worse in itertools.combinations(responses, 2):
            if better.strip() == worse.strip():
                report.skip("chosen == rejected")
            else:
                pairs.append((better, worse))
        return pairs
    chosen, rejected = _row_text(row, "chosen"), _row_text(row, "rejected")
    if chosen.strip() == rejected.strip():
        raise BadRow("chosen == rejected")
    return [(chosen, rejected)]


def split_implicit_prompt(
    chosen: list[dict], rejected: list[dict]
) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt, chosen, rejected) of two whole conversations: the prompt is their shared
    leading messages (TRL's implicit prompt); what follows must be assistant turns."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if chosen == rejected:
        raise BadRow("chosen == rejected")
    rest = chosen[n:] + rejected[n:]
    if n == 0 or any(m["role"] != "assistant" for m in rest) or chosen[n - 1]["role"] != "user":
        raise BadRow("chosen and rejected have different prompts")
    return chosen[:n], chosen[n:], rejected[n:]


def chat_preference_messages(
    row: dict, prompt_field: str
) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt, chosen, rejected) message lists of a conversational preference row."""
    chosen, rejected = _row_messages(row, "chosen"), _row_messages(row, "rejected")
    if row.get(prompt_field) is None:
        return split_implicit_prompt(chosen, rejected)
    prompt = check_prompt_turns(_row_messages(row, prompt_field), "prompt")
    for name, turns in (("chosen", chosen), ("rejected", rejected)):
        if any(m["role"] != "assistant" for m in turns):
            raise BadRow(f"'{name}' holds turns other than the assistant's")
    if chosen == rejected:
        raise BadRow("chosen == rejected")
    return prompt, chosen, rejected


def preference_row(
    render: RowRender, row: dict, responses_field: str, report: SkipReport
) -> tuple[Text, Sequence[tuple[Text, Text]]]:
    """(prompt, [(chosen, rejected), ...]) of one preference row, texts or message lists:
    an explicit or implicit prompt, or (text) a ranked list's C(n,2) pairs."""
    if render.chat is not None:
        prompt, chosen, rejected = chat_preference_messages(row, render.data_cfg.prompt_field)
        return prompt, [(chosen, rejected)]
    return render.prompt(row), _text_pairs(row, responses_field, report)


def preference_pairs(
    rows: list[dict],
    tokenizer: PreTrainedTokenizerBase,
    data_cfg: DataConfig,
    responses_field: str = "responses",
    where: str = "data.train",
    vision: VisionInputs | None = None,
) -> tuple[list[PreferencePair], SkipReport]:
    """Preference pairs of a file (docs/data.md): text or conversational chosen/rejected,
    with an explicit or implicit prompt, or text ranked lists. Conversations are rendered
    whole (the reward model reads them as PPO will show them), closed by a stop token.
    With `vision`, a prompt may hold images (docs/vision.md)."""
    names = (data_cfg.prompt_field, "chosen", "rejected")
    render = row_render(tokenizer, data_cfg, is_conversational(rows, names), where)

    def encode(row: dict, report: SkipReport) -> list[PreferencePair]:
        explicit = row.get(data_cfg.prompt_field) is not None
        holders = names[:1] if explicit else names[1:]
        row, images = with_images(vision, row, holders, names[1:] if explicit else ())
        prompt, pairs = preference_row(render, row, responses_field, report)
        seqs = render.sequences(prompt, [r for pair in pairs for r in pair], report)
        turns = cast("list[dict]", prompt) if render.chat is not None else None
        out = []
        for pair, chosen, rejected in zip(pairs, seqs[::2], seqs[1::2]):

            def rerender(messages: list[dict], pair: tuple[Text, Text] = pair) -> list[Seq]:
                return render.sequences(messages, list(pair), report)

            fitted = fit_item(render, [chosen, rejected], report, turns, rerender)
            if fitted is not None:
                limit = ("data.max_length", data_cfg.max_length)
                chosen_ids, trained, media = expand_images(vision, *fitted[0], images, limit)
                rejected_ids = expand_images(vision, *fitted[1], images, limit)[0]
                category, prompt_len = row.get("category"), trained.index(True)
                out.append(PreferencePair(chosen_ids, rejected_ids, category, prompt_len, media))
        return out

    return encode_each(rows, encode)


def collate_pairs(batch: list[PreferencePair], pad_id: int) -> dict[str, torch.Tensor]:
    """Chosen then rejected sequences stacked into one (2B, L) batch, so one forward pass
    scores both; `last_index` (2B,) is each sequence's EOS position."""
    seqs = [p.chosen for p in batch] + [p.rejected for p in batch]
    ids, attn = right_pad(seqs, pad_id)
    return {"input_ids": ids, "attention_mask": attn, "last_index": last_token_index(attn)}


# ---------------------------------------------------------------------- unpaired (KTO)


@dataclass
class KTOExample:
    """One labelled completion; `kl_completion` is ANOTHER example's completion, which with
    this prompt makes the mismatched pair KTO's reference point is estimated from."""

    prompt: list[int]
    completion: list[int]  # response ids + EOS (conversations: the turn up to its stop token)
    desirable: bool
    kl_completion: list[int] = field(default_factory=list)
    media: Media | None = None  # pixel inputs of the prompt's images (data/vision.py)


def _unique(items: list[T]) -> list[T]:
    """`items` in first-seen order without repeats (message lists are not hashable)."""
    out: list[T] = []
    for item in items:
        if item not in out:
            out.append(item)
    return out


def kto_row(
    render: RowRender, row: dict, kto_cfg: KTOConfig, report: SkipReport
) -> tuple[Text, list[tuple[Text, bool]]]:
    """(prompt, [(completion, desirable), ...]) of one row, texts or message lists:
    TRL's unpaired format (prompt, completion, label), or a preference row (chosen
    desirable, rejected undesirable)."""
    if row.get(kto_cfg.completion_field) is None:
        prompt, pairs = preference_row(render, row, kto_cfg.responses_field, report)
        chosen, rejected = _unique([c for c, _ in pairs]), _unique([r for _, r in pairs])
        # A middle response of a ranked list is both preferred and dispreferred: neither.
        labelled = [(c, True) for c in chosen if c not in rejected]
        return prompt, labelled + [(r, False) for r in rejected if r not in chosen]
    prompt = render.prompt(row)
    completion = render.response(row, kto_cfg.completion_field)
    label = row.get(kto_cfg.label_field)
    if not isinstance(label, bool):
        raise BadRow(f"'{kto_cfg.label_field}' not true/false")
    return prompt, [(completion, label)]


def kto_examples(
    rows: list[dict],
    tokenizer: PreTrainedTokenizerBase,
    data_cfg: DataConfig,
    kto_cfg: KTOConfig,
    where: str = "data.train",
    vision: VisionInputs | None = None,
) -> tuple[list[KTOExample], SkipReport]:
    """KTO examples from unpaired rows (TRL's format: prompt, completion, label) or from
    preference rows (chosen -> desirable, rejected -> undesirable), text or conversational;
    each example's `kl_completion` is the completion of the next example with a different
    prompt. With `vision`, a prompt may hold images (docs/vision.md)."""
    names = (data_cfg.prompt_field, kto_cfg.completion_field, "chosen", "rejected")
    render = row_render(tokenizer, data_cfg, is_conversational(rows, names), where)

    def encode(row: dict, report: SkipReport) -> list[KTOExample]:
        explicit = row.get(names[0]) is not None
        row, images = with_images(vision, row, names[:1] if explicit else names[2:], names[1:])
        prompt, labelled = kto_row(render, row, kto_cfg, report)
        seqs = render.sequences(prompt, [c for c, _ in labelled], report)
        turns = cast("list[dict]", prompt) if render.chat is not None else None
        out = []
        for seq, (completion, desirable) in zip(seqs, labelled):

            def rerender(messages: list[dict], completion: Text = completion) -> list[Seq]:
                return render.sequences(messages, [completion], report)

            fitted = fit_item(render, [seq], report, turns, rerender)
            if fitted is not None:
                limit = ("data.max_length", data_cfg.max_length)
                ids, trained, media = expand_images(vision, *fitted[0], images, limit)
                n = trained.index(True)  # the prompt's tokens, then the completion's
                out.append(KTOExample(ids[:n], ids[n:], desirable, media=media))
        return out

    out, report = encode_each(rows, encode)
    for i, ex in enumerate(out):
        # Cyclic, so every example has a partner; equal prompts are skipped where possible
        # (the pair must not be a real one). Not shuffled: the order is the data's.
        others = (out[(i + k) % len(out)] for k in range(1, len(out)))
        partner = next((o for o in others if o.prompt != ex.prompt), out[(i + 1) % len(out)])
        ex.kl_completion = partner.completion
    return out, report
