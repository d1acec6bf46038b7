"""Images in data rows (docs/vision.md): TRL 1.16's vision formats read as they are, and
the pixel inputs a vision-language model takes, carried per row and joined per batch.

A row's images come from its `image` (one) or `images` (a list) column as PIL images,
file paths, bytes or the {"bytes", "path"} dicts `datasets.Image` stores. Its messages
hold them as {"type": "image"} parts of a list-of-parts content, or, when every content
is a string, TRL's rule places them before the text of the first user message
(trl/data_utils.py `prepare_multimodal_messages`). Each image part becomes the processor's
placeholder text in a string content, so the chat templates, the assistant-token masks
and the truncation rules of text rows apply unchanged; after tokenising, each
placeholder token is replaced by the tokens the processor gives that image (LLaVA: one
`<image>` per patch feature; Qwen2-VL: `<|image_pad|>` per merged patch) and the row
keeps the processor's other outputs (`pixel_values`, `image_grid_thw`, `image_sizes`,
...) by name, never by family: a batch joins them along dim 0 (`collate_media`).
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlhf_dist.data.chat import BadRow
from rlhf_dist.errors import ConfigError

# Per-image pixel inputs of one row or one batch, by the processor's names: each tensor's
# dim 0 runs over images (pixel_values (n, C, H, W) for LLaVA, (patches, D) for Qwen2-VL,
# whose image_grid_thw (n, 3) says how many patches each image has). A 0-dim entry is a
# per-token input instead (Qwen2-VL's mm_token_type_ids, Gemma 3's token_type_ids): 1 on
# the tokens whose id it holds (the image token), 0 elsewhere, built for each forward's
# ids by `token_inputs`, so padding, prompts + responses and trimming need nothing.
Media = dict[str, torch.Tensor]
# Processor outputs that are not per-image pixel inputs: the text side of its output.
TEXT_KEYS = ("input_ids", "attention_mask")


def load_image(value: Any) -> Any:
    """A PIL image (RGB) from a PIL image, a path, bytes or a {"bytes", "path"} dict; a
    missing file or undecodable data is BadRow with the reason (a counted skip)."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, (bytes, bytearray)):
        source: Any = io.BytesIO(value)
    elif isinstance(value, str) and value:
        if not Path(value).expanduser().is_file():
            raise BadRow("image file not found")
        source = str(Path(value).expanduser())
    else:
        raise BadRow("image not a PIL image, path or bytes")
    try:
        with Image.open(source) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError):
        raise BadRow("unreadable image") from None


def row_images(row: dict) -> list[Any]:
    """The PIL images of a row's `images` (a list) or `image` column, in order; [] if
    it has neither (a text row of a vision run)."""
    many, one = row.get("images"), row.get("image")
    if many is not None:
        if not isinstance(many, (list, tuple)):
            raise BadRow("'images' not a list")
        return [load_image(v) for v in many]
    return [] if one is None else [load_image(one)]


def flatten_messages(messages: Any, n_images: int, placeholder: str, name: str) -> Any:
    """`messages` with every image as `placeholder` text in string contents; anything
    that is not a message list is returned as it is (the text checks then report it).

    List-of-parts contents: {"type": "image"} parts become `placeholder`, text parts
    their text, joined in order. All-string contents with images: TRL's rule, the images
    go before the text of the first user message. The image parts must number exactly
    `n_images`, else BadRow."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        return messages
    parts = any(isinstance(m.get("content"), list) for m in messages)
    out, placed = [], 0
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            text, n = _join_parts(content, placeholder, name)
            placed += n
        elif not parts and m.get("role") == "user" and placed == 0 and n_images:
            text, placed = placeholder * n_images + (content or ""), n_images
        else:
            text = content
        out.append({**m, "content": text})
    if placed != n_images:
        raise BadRow(f"image count differs from the image placeholders in '{name}'")
    return out


def message_images(
    messages: Sequence[dict], placeholder: str, given: Sequence[Any] = ()
) -> tuple[list[dict], list[Any]]:
    """(messages, their images in order) of a multi-turn episode's messages
    (rollout/agent.py): each list-of-parts content joined into a string, every image part
    as `placeholder`. An image part carrying its image (TRL's {"type": "image", "image":
    a PIL image, path, bytes or {"bytes", "path"} dict}, or an OpenAI {"type":
    "image_url"} part with a base64 data URL) gives that image; an image part without
    one, and a placeholder already in a text, stands for the next of `given` (the prompt
    row's images), all of which must be used. BadRow: an unreadable image, a part neither
    text nor image, or a count that differs."""
    pending, images, out = list(given)[::-1], [], []

    def text_of(text: str) -> str:
        for _ in range(text.count(placeholder)):  # the row's images, in order
            images.append(_next_given(pending))
        return text

    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            content = text_of(content)
        elif isinstance(content, list):
            texts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    texts.append(text_of(part["text"]))
                elif kind in ("image", "image_url"):
                    images.append(_part_image(part) or _next_given(pending))
                    texts.append(placeholder)
                else:
                    raise BadRow("a content part of a message is neither text nor image")
            content = "".join(texts)
        out.append({**m, "content": content})
    if pending:
        raise BadRow("image count differs from the image placeholders in the messages")
    return out, images


def _next_given(pending: list[Any]) -> Any:
    """The next of a prompt row's images (`message_images`; `pending` reversed)."""
    if not pending:
        raise BadRow("image count differs from the image placeholders in the messages")
    return load_image(pending.pop())


def _part_image(part: dict) -> Any | None:
    """The PIL image an image part carries (`message_images`), None when it carries none."""
    if part.get("type") == "image":
        value = part.get("image")
        return None if value is None else load_image(value)
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    head, _, data = url.partition(",") if isinstance(url, str) else ("", "", "")
    if not (head.startswith("data:image/") and head.endswith(";base64")):
        raise BadRow("an image_url part without a base64 data URL (data:image/<type>;base64,...)")
    try:
        return load_image(base64.b64decode(data, validate=True))
    except (binascii.Error, ValueError):
        raise BadRow("an image_url part whose data is not base64") from None


def _join_parts(content: list, placeholder: str, name: str) -> tuple[str, int]:
    """(text, image count) of one list-of-parts content."""
    texts, n = [], 0
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image":
            texts.append(placeholder)
            n += 1
        elif kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise BadRow(f"a content part of '{name}' is neither text nor image")
    return "".join(texts), n


@dataclass(frozen=True)
class VisionInputs:
    """A vision-language policy's processor and how its images enter a row's tokens.

    placeholder: the text one image part renders as (processor.image_token, or Gemma 3's
    begin-of-image token, which its processor expands); placeholder_id: its token id;
    image_token_id: the id of the tokens the model fills with image features
    (processor.image_token), which a response must not hold (`RowMedia`)."""

    processor: Any
    placeholder: str
    placeholder_id: int
    image_token_id: int

    def images_of(self, row: dict) -> list[Any]:
        """The row's images (`row_images`)."""
        return row_images(row)

    def flat_row(
        self, row: dict, holders: Sequence[str], others: Sequence[str], images: list[Any]
    ) -> dict:
        """`row` with the message lists under `holders` and `others` flattened
        (`flatten_messages`): each of `holders` holds all the images (a prompt, an SFT
        row's `messages`, or both sequences of an implicit-prompt pair), `others` none. A
        text value with images is BadRow: TRL reads images with conversational rows."""
        out = dict(row)
        for name in (*holders, *others):
            value = row.get(name)
            if value is None:
                continue
            n = len(images) if name in holders else 0
            if isinstance(value, str) and n:
                raise BadRow(f"images with a text '{name}' (use conversational rows)")
            out[name] = flatten_messages(value, n, self.placeholder, name)
        return out

    def expand(
        self, ids: list[int], trained: list[bool], images: list[Any]
    ) -> tuple[list[int], list[bool], Media | None]:
        """(ids, trained, media) with the i-th placeholder token replaced by the tokens
        the processor gives image i (never trained), and the processor's per-image inputs
        joined along dim 0; media None without images. A placeholder count different
        from the image count (the text itself holds the placeholder) is BadRow."""
        spots = [t for t, i in enumerate(ids) if i == self.placeholder_id]
        if len(spots) != len(images):
            raise BadRow("image count differs from the image placeholder tokens")
        if not images:
            return ids, trained, None
        out_ids, out_trained, parts, start = [], [], [], 0
        for spot, image in zip(spots, images):
            tokens, inputs = self.image_tokens(image)
            out_ids += ids[start:spot] + tokens
            out_trained += trained[start:spot] + [False] * len(tokens)
            parts.append(inputs)
            start = spot + 1
        out_ids += ids[start:]
        out_trained += trained[start:]
        return out_ids, out_trained, join_media(parts)

    def image_tokens(self, image: Any) -> tuple[list[int], Media]:
        """(the tokens that stand for `image` in the sequence, its pixel inputs)."""
        try:
            out = self.processor(
                text=[self.placeholder],
                images=[image],
                add_special_tokens=False,
                return_tensors="pt",
            )
        except (ValueError, OSError, TypeError) as e:
            raise BadRow(f"processor refused an image ({type(e).__name__})") from None
        ids = out["input_ids"][0]
        media = {}
        for name, value in out.items():
            if name in TEXT_KEYS or not torch.is_tensor(value):
                continue
            if value.shape == out["input_ids"].shape:  # per token: 1 on image tokens only
                if not torch.equal(value[0].long(), (ids == self.image_token_id).long()):
                    raise ConfigError(
                        f"model.policy: the processor's per-token {name!r} is not supported"
                    )
                value = torch.tensor(self.image_token_id)
            media[name] = value
        return ids.tolist(), media


def vision_inputs(processor: Any, where: str) -> VisionInputs:
    """The VisionInputs of a loaded processor (models.vision.load_processor)."""
    image = getattr(processor, "image_token", None)
    text = getattr(processor, "boi_token", None) or image
    ids = [_token_id(processor.tokenizer, t) for t in (text, image)]
    if not isinstance(text, str) or ids[0] is None or ids[1] is None:
        raise ConfigError(f"{where}: the processor names no single-token image placeholder")
    return VisionInputs(processor, text, ids[0], ids[1])


def _token_id(tokenizer: Any, text: Any) -> int | None:
    """The id of `text` when the tokenizer encodes it as one token, else None."""
    if not isinstance(text, str):
        return None
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return int(ids[0]) if len(ids) == 1 else None


def join_media(parts: Sequence[Media | None]) -> Media:
    """Per-image inputs of several rows (or images) joined along dim 0, in order; rows
    without images (None) add nothing. Every row with images must give the same names."""
    present = [p for p in parts if p]
    if not present:
        return {}
    names = set(present[0])
    if any(set(p) != names for p in present):
        raise ValueError("rows of one batch give different pixel inputs")
    return {
        k: present[0][k] if present[0][k].dim() == 0 else torch.cat([p[k] for p in present])
        for k in sorted(names)
    }


def token_inputs(input_ids: torch.Tensor, media: Media | None) -> Media:
    """The model inputs of a batch's images for a forward over `input_ids` (B, L): the
    per-image ones moved to input_ids' device (the processor made them on the host), each
    per-token one (a 0-dim entry holding a token id, `Media`) as a (B, L) long tensor, 1
    where input_ids holds that id."""
    out = {}
    for name, value in (media or {}).items():
        value = value.to(input_ids.device)
        out[name] = (input_ids == value).long() if value.dim() == 0 else value
    return out


@dataclass(frozen=True)
class RowMedia:
    """The pixel inputs of a batch's rows, one entry per row (None: a row without images),
    kept per row so that a batch's rows can be selected, reordered and joined like its
    tensors (RolloutBatch.select, dynamic sampling's merge) before one forward takes them
    joined (`joined`)."""

    rows: tuple[Media | None, ...]
    # the token the model fills with image features (VisionInputs.image_token_id): a
    # sampled one would ask for an image the prompt does not have, so a response is cut
    # before it (engine/decode.py `cut_before`)
    image_token_id: int
    # each row's decoded images (PIL), for a sampler that runs the processor itself
    # (vLLM's multi_modal_data, generation/vllm_images.py); () where not kept
    images: tuple[tuple[Any, ...], ...] = ()

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: torch.Tensor | slice) -> RowMedia:
        """The rows `index`: a slice, (k,) int64 indices or a (B,) bool mask."""
        if isinstance(index, slice):
            return RowMedia(self.rows[index], self.image_token_id, self.images[index])
        if index.dtype == torch.bool:
            index = index.nonzero().flatten()
        picked = index.tolist()
        images = tuple(self.images[i] for i in picked) if self.images else ()
        return RowMedia(tuple(self.rows[i] for i in picked), self.image_token_id, images)

    def joined(self) -> Media | None:
        """The model inputs of these rows' images in row order (`join_media`); None
        when no row has an image."""
        return join_media(self.rows) or None

    @staticmethod
    def cat(parts: Sequence[RowMedia]) -> RowMedia:
        """The rows of `parts` one after another."""
        rows = tuple(m for part in parts for m in part.rows)
        kept = all(len(part.images) == len(part) for part in parts)
        images = tuple(i for part in parts for i in part.images) if kept else ()
        return RowMedia(rows, parts[0].image_token_id, images)
