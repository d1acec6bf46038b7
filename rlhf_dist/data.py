"""Prompt, SFT and preference data: loading with `datasets`, tokenising, collating.

Data sources are local .jsonl/.json/.parquet/.csv files or hub dataset names. Rows a
user got wrong (missing field, empty text, wrong type, too long) are skipped and counted
with a reason; the counts are reported, never silently dropped.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlhf_dist.config import ConfigError

LOCAL_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass
class SkipReport:
    """Counts of rows skipped, by reason."""

    kept: int = 0
    truncated: int = 0
    skipped: Counter = field(default_factory=Counter)

    def skip(self, reason: str) -> None:
        self.skipped[reason] += 1

    def summary(self, what: str) -> str:
        text = f"{what}: {self.kept} kept"
        if self.truncated:
            text += f", {self.truncated} prompts truncated to their last tokens"
        if self.skipped:
            reasons = ", ".join(f"{n} {r}" for r, n in self.skipped.most_common())
            text += f", {sum(self.skipped.values())} skipped ({reasons})"
        return text


def _non_blank(path: Path, limit: int) -> bytes:
    """Up to `limit` non-whitespace bytes from the start of a file (reads no further)."""
    found = b""
    with path.open("rb") as f:
        while len(found) < limit and (chunk := f.read(1 << 16)):
            found += b"".join(chunk.split())[: limit - len(found)]
    return found


def _csv_has_a_row(path: Path) -> bool:
    """A non-blank line after the header line."""
    with path.open("rb") as f:
        lines = (line for line in f if line.strip())
        return next(lines, None) is not None and next(lines, None) is not None


def _why_no_rows(path: Path) -> str | None:
    """Why a local data file holds no rows, or None if it may hold some. Checked before
    `datasets` reads it: that reports such files as "StopIteration" or "corresponds to no
    data", which does not tell the user the file is empty."""
    head = _non_blank(path, 3)
    if not head:
        return "is empty"
    if path.suffix == ".json" and head == b"[]":
        return "has no rows (an empty JSON list)"
    if path.suffix == ".csv" and not _csv_has_a_row(path):
        return "has a header line but no rows"
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        if pq.ParquetFile(path).metadata.num_rows == 0:
            return "has no rows"
    return None


def load_rows(source: str, key: str, split: str = "train") -> list[dict]:
    """Rows of a local data file (by extension) or a hub dataset, as a list of dicts."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    path = Path(source).expanduser()
    try:
        if path.suffix in LOCAL_BUILDERS:
            if not path.is_file():
                raise ConfigError(f"{key}: data file {source!r} does not exist")
            empty = _why_no_rows(path)
            if empty:
                raise ConfigError(f"{key}: data file {source!r} {empty}")
            ds = datasets.load_dataset(
                LOCAL_BUILDERS[path.suffix], data_files=str(path), split="train"
            )
        elif path.exists():
            raise ConfigError(f"{key}: {source!r} is not a .jsonl/.json/.parquet/.csv file")
        else:
            ds = datasets.load_dataset(source, split=split)
        return list(ds)  # inside the try: undecodable text only fails here
    except ConfigError:
        raise
    except Exception as e:  # datasets raises many types for unreadable/absent data
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"{key}: cannot load {source!r}: {first}") from None


def _text(row: dict, name: str, report: SkipReport) -> str | None:
    value = row.get(name)
    if value is None:
        report.skip(f"missing '{name}'")
        return None
    if not isinstance(value, str):
        report.skip(f"'{name}' not text")
        return None
    if not value.strip():
        report.skip(f"empty '{name}'")
        return None
    return value


def encode_prompt(tokenizer, text: str, max_len: int, too_long: str, report: SkipReport):
    """Prompt token ids (BOS added if the tokenizer adds one); long prompts keep their end."""
    ids = tokenizer(text)["input_ids"]
    if len(ids) > max_len:
        if too_long == "drop":
            report.skip("prompt too long")
            return None
        report.truncated += 1
        ids = ids[-max_len:]
    return ids


def encode_response(tokenizer, text: str) -> list[int]:
    """Response ids followed by EOS: the reward is read at the EOS token."""
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


# ----------------------------------------------------------------------------- prompts


@dataclass
class PromptSet:
    texts: list[str]
    ids: list[list[int]]
    report: SkipReport


def prompt_set(rows: list[dict], tokenizer, data_cfg) -> PromptSet:
    report = SkipReport()
    texts, ids = [], []
    for row in rows:
        text = _text(row, data_cfg.prompt_field, report)
        if text is None:
            continue
        enc = encode_prompt(tokenizer, text, data_cfg.max_prompt_length, data_cfg.too_long, report)
        if enc is None:
            continue
        texts.append(text)
        ids.append(enc)
    report.kept = len(ids)
    if not ids:
        raise ConfigError(f"data: no usable prompts ({report.summary('prompts')})")
    return PromptSet(texts, ids, report)


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
    ids: list[int]
    prompt_len: int


def sft_examples(rows: list[dict], tokenizer, data_cfg, response_field: str = "response"):
    """Prompt+response(+EOS) sequences; the loss covers response tokens only."""
    report = SkipReport()
    out = []
    for row in rows:
        prompt = _text(row, data_cfg.prompt_field, report)
        response = _text(row, response_field, report) if prompt is not None else None
        if response is None:
            continue
        p = encode_prompt(tokenizer, prompt, data_cfg.max_prompt_length, data_cfg.too_long, report)
        if p is None:
            continue
        r = encode_response(tokenizer, response)
        if len(p) + len(r) > data_cfg.max_length:
            report.skip("longer than data.max_length")
            continue
        out.append(SFTExample(p + r, len(p)))
    report.kept = len(out)
    return out, report


def collate_sft(batch: list[SFTExample], pad_id: int) -> dict[str, torch.Tensor]:
    """input_ids/attention_mask (B, L) and loss_mask (B, L-1): True where token t+1 is a
    response token the logits at t must predict."""
    ids, attn = right_pad([ex.ids for ex in batch], pad_id)
    positions = torch.arange(ids.shape[1] - 1)
    starts = torch.tensor([ex.prompt_len - 1 for ex in batch]).unsqueeze(1)
    lengths = attn.sum(1, keepdim=True)
    loss_mask = (positions >= starts) & (positions < lengths - 1)
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask}


# -------------------------------------------------------------------------- preferences


@dataclass
class PreferencePair:
    chosen: list[int]
    rejected: list[int]
    category: str | None = None
    prompt_len: int = 0  # tokens of the shared prompt: the rest of each sequence is its response


def _pairs_of_row(row: dict, data_cfg, responses_field: str, report: SkipReport):
    """(chosen, rejected) texts of one row: a pair, or all C(n,2) pairs of a ranked list."""
    # `datasets` fills absent columns with None, so a mixed file has chosen=None on ranked rows.
    if row.get(responses_field) is not None and row.get("chosen") is None:
        responses = row[responses_field]
        if not isinstance(responses, list) or len(responses) < 2:
            report.skip(f"'{responses_field}' not a list of 2+ texts")
            return []
        if not all(isinstance(r, str) and r.strip() for r in responses):
            report.skip(f"empty or non-text entry in '{responses_field}'")
            return []
        # Best-first ranking: every earlier response is preferred to every later one.
        pairs = []
        for better, worse in itertools.combinations(responses, 2):
            if better.strip() == worse.strip():
                report.skip("chosen == rejected")
            else:
                pairs.append((better, worse))
        return pairs
    chosen = _text(row, "chosen", report)
    rejected = _text(row, "rejected", report) if chosen is not None else None
    if rejected is None:
        return []
    if chosen.strip() == rejected.strip():
        report.skip("chosen == rejected")
        return []
    return [(chosen, rejected)]


def preference_pairs(rows: list[dict], tokenizer, data_cfg, responses_field: str = "responses"):
    report = SkipReport()
    out = []
    for row in rows:
        prompt = _text(row, data_cfg.prompt_field, report)
        if prompt is None:
            continue
        p = encode_prompt(tokenizer, prompt, data_cfg.max_prompt_length, data_cfg.too_long, report)
        if p is None:
            continue
        for chosen, rejected in _pairs_of_row(row, data_cfg, responses_field, report):
            c, r = p + encode_response(tokenizer, chosen), p + encode_response(tokenizer, rejected)
            if max(len(c), len(r)) > data_cfg.max_length:
                report.skip("longer than data.max_length")
                continue
            out.append(PreferencePair(c, r, row.get("category"), len(p)))
    report.kept = len(out)
    return out, report


def collate_pairs(batch: list[PreferencePair], pad_id: int) -> dict[str, torch.Tensor]:
    """Chosen then rejected sequences stacked into one (2B, L) batch, so one forward pass
    scores both; `last_index` (2B,) is each sequence's EOS position."""
    seqs = [p.chosen for p in batch] + [p.rejected for p in batch]
    ids, attn = right_pad(seqs, pad_id)
    return {"input_ids": ids, "attention_mask": attn, "last_index": attn.sum(1) - 1}


# ---------------------------------------------------------------------- unpaired (KTO)


@dataclass
class KTOExample:
    """One labelled completion; `kl_completion` is ANOTHER example's completion, which with
    this prompt makes the mismatched pair KTO's reference point is estimated from."""

    prompt: list[int]
    completion: list[int]  # response ids + EOS
    desirable: bool
    kl_completion: list[int] = field(default_factory=list)


def _kto_texts_of_row(row: dict, data_cfg, kto_cfg, report: SkipReport) -> list[tuple[str, bool]]:
    """(completion, desirable) of one row: unpaired (completion + label) or from preferences."""
    if row.get(kto_cfg.completion_field) is None:
        pairs = _pairs_of_row(row, data_cfg, kto_cfg.responses_field, report)
        chosen = dict.fromkeys(c for c, _ in pairs)  # dicts keep first-seen order
        rejected = dict.fromkeys(r for _, r in pairs)
        # A middle response of a ranked list is both preferred and dispreferred: neither.
        return [(c, True) for c in chosen if c not in rejected] + [
            (r, False) for r in rejected if r not in chosen
        ]
    completion = _text(row, kto_cfg.completion_field, report)
    if completion is None:
        return []
    label = row.get(kto_cfg.label_field)
    if not isinstance(label, bool):
        report.skip(f"'{kto_cfg.label_field}' not true/false")
        return []
    return [(completion, label)]


def kto_examples(rows: list[dict], tokenizer, data_cfg, kto_cfg):
    """KTO examples from unpaired rows (TRL's format: prompt, completion, label) or from
    preference rows (chosen -> desirable, rejected -> undesirable); each example's
    `kl_completion` is the completion of the next example with a different prompt."""
    report, out = SkipReport(), []
    for row in rows:
        prompt = _text(row, data_cfg.prompt_field, report)
        if prompt is None:
            continue
        p = encode_prompt(tokenizer, prompt, data_cfg.max_prompt_length, data_cfg.too_long, report)
        if p is None:
            continue
        for text, desirable in _kto_texts_of_row(row, data_cfg, kto_cfg, report):
            completion = encode_response(tokenizer, text)
            if len(p) + len(completion) > data_cfg.max_length:
                report.skip("longer than data.max_length")
                continue
            out.append(KTOExample(p, completion, desirable))
    for i, ex in enumerate(out):
        # Cyclic, so every example has a partner; equal prompts are skipped where possible
        # (the pair must not be a real one). Not shuffled: the order is the data's.
        others = (out[(i + k) % len(out)] for k in range(1, len(out)))
        partner = next((o for o in others if o.prompt != ex.prompt), out[(i + 1) % len(out)])
        ex.kl_completion = partner.completion
    report.kept = len(out)
    return out, report
