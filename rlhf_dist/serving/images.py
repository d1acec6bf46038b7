"""Images on the rollout server (docs/serving.md, "Images"): what a request carries and
how it becomes the pixel inputs the trainer's own path makes (data/vision.py).

- /v1/chat/completions: OpenAI `image_url` parts whose url is a base64 data URL
  (`data:image/png;base64,...`). Each becomes an {"type": "image"} part, the messages
  are flattened to the processor's placeholder and tokenised as a training row's are,
  and each placeholder is expanded to the image's tokens (`VisionInputs.expand`). An
  http(s) URL is refused: nothing outside the server is fetched.
- /generate: beside each prompt's token ids (the image tokens already expanded, as the
  trainer's prompts are), either its images as base64 image files (run through the
  served processor) or its pixel inputs themselves (`PixelTensor`: what the trainer's
  sampler sends, so the server's prefill reads the very tensors the trainer's forward
  does).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from rlhf_dist.data.chat import BadRow, Chat
from rlhf_dist.data.vision import Media, VisionInputs, flatten_messages, join_media, load_image
from rlhf_dist.generation.server import tensor_of
from rlhf_dist.serving.policy import BadRequest, PromptMedia, ServedPolicy


def decode_image(data: str, where: str) -> Any:
    """The PIL image of base64 text `data` (the bytes of an image file); BadRequest."""
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"{where}: not base64") from None
    try:
        return load_image(raw)
    except BadRow as e:
        raise BadRequest(f"{where}: {e}") from None


def data_url_image(url: str, where: str) -> Any:
    """The PIL image of a `data:image/...;base64,...` URL; BadRequest for anything else
    (an http(s) URL names why: the server fetches nothing)."""
    if url.startswith(("http://", "https://")):
        raise BadRequest(f"{where}: http(s) image URLs are not fetched; send a base64 data URL")
    head, _, data = url.partition(",")
    if not (head.startswith("data:image/") and head.endswith(";base64")):
        raise BadRequest(f"{where}: not a base64 data URL (data:image/<type>;base64,...)")
    return decode_image(data, where)


def chat_images(messages: list[dict]) -> tuple[list[dict], list[Any]]:
    """(messages, images): each OpenAI `image_url` part of a list content replaced by an
    {"type": "image"} part (data/vision.py reads those) and its image decoded, in order;
    a part that is neither text nor image_url is BadRequest."""
    out, images = [], []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for j, part in enumerate(content):
            kind, where = part.get("type"), f"messages[{i}].content[{j}]"
            if kind == "text":
                parts.append({"type": "text", "text": str(part.get("text", ""))})
            elif kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str):
                    raise BadRequest(f"{where}: image_url without a url")
                images.append(data_url_image(url, where))
                parts.append({"type": "image"})
            else:
                raise BadRequest(f"{where}: only text and image_url parts are supported")
        out.append({**m, "content": parts})
    return out, images


def episode_images(
    vision: VisionInputs | None, messages: list[dict]
) -> tuple[list[dict], list[Any]]:
    """(messages as the chat template reads them, their images in order) of an episode's
    messages (serving/episodes.py): a vision-language model's `image_url` parts each as
    the processor's placeholder (`chat_images`, then data/vision.py `flatten_messages`);
    a text model's messages as they are. BadRequest or BadRow (a count that differs)."""
    if vision is None:
        return messages, []
    messages, images = chat_images(messages)
    return flatten_messages(messages, len(images), vision.placeholder, "messages"), images


def chat_prompt(
    chat: Chat, vision: VisionInputs | None, messages: list[dict]
) -> tuple[list[int], Media | None]:
    """(prompt ids, pixel inputs or None) of a chat request's messages, rendered with the
    generation prompt: for a vision-language model as a training prompt is
    (data/rows.py: the image parts flattened to the placeholder, then each placeholder
    expanded to its image's tokens); BadRequest for what the trainer would skip."""
    try:
        if vision is None:
            return chat.prompt_ids(messages), None
        messages, images = chat_images(messages)
        flat = flatten_messages(messages, len(images), vision.placeholder, "messages")
        ids = chat.prompt_ids(flat)
        ids, _, media = vision.expand(ids, [False] * len(ids), images)
    except BadRow as e:
        raise BadRequest(f"messages: {e}") from None
    return ids, media


def prompt_media(vision: VisionInputs, prompt: list[int], images: list[Any], i: int) -> Media:
    """The pixel inputs of prompt `i`'s decoded `images`, the processor's; BadRequest when
    the prompt's image tokens are not the ones those images take, in number."""
    try:
        made = [vision.image_tokens(image) for image in images]
    except BadRow as e:
        raise BadRequest(f"images[{i}]: {e}") from None
    want = sum(tokens.count(vision.image_token_id) for tokens, _ in made)
    have = prompt.count(vision.image_token_id)
    if want != have:
        raise BadRequest(
            f"images[{i}]: the images take {want} image tokens, the prompt holds {have}"
        )
    return join_media([m for _, m in made])


def pixels_of(specs: dict[str, dict], i: int) -> Media:
    """One row's pixel inputs from /generate's `pixels` entry (generation/server.py
    `pixel_specs` wrote it); BadRequest."""
    try:
        return {k: tensor_of(v) for k, v in specs.items()}
    except ValueError as e:
        raise BadRequest(f"pixels[{i}]: {e}") from None


def generate_media(
    policy: ServedPolicy, prompts: list[list[int]], images: list[list[str]] | None,
    pixels: list[dict[str, dict] | None] | None,
) -> PromptMedia:  # fmt: skip
    """Each /generate prompt's pixel inputs from its `images` (base64 image files, run
    through the served processor) or its `pixels` (`pixels_of`); None without either.
    BadRequest for both, a count that is not the prompts', or images to a text model."""
    if images is None and pixels is None:
        return None
    if images is not None and pixels is not None:
        raise BadRequest("images: send images or pixels, not both")
    given: list = images if images is not None else pixels  # type: ignore[assignment]
    if len(given) != len(prompts):
        raise BadRequest(f"images: {len(given)} entries for {len(prompts)} prompts")
    if pixels is not None:
        return [None if p is None else pixels_of(p, i) for i, p in enumerate(pixels)]
    vision = policy.vision
    if vision is None:
        raise BadRequest("images: the served model is not a vision-language model")
    out: list[Media | None] = []
    for i, (prompt, files) in enumerate(zip(prompts, images or [])):
        decoded = [decode_image(f, f"images[{i}][{j}]") for j, f in enumerate(files)]
        out.append(prompt_media(vision, prompt, decoded, i) if decoded else None)
    return out
