"""Tiny vision-language models built locally from configs, with their real processors, for
the vision tests (tests/*vision*). No hub download: every piece is made here.

LLaVA-style (`build_tiny_llava`): a CLIP vision tower of one layer on 16 x 16 images in
8 x 8 patches (4 image tokens per image: the CLS feature is dropped, the `default`
feature-select strategy), a 2-layer projector and the demo task's tiny Llama, with
`LlavaProcessor` over the PIL CLIP image processor (no torchvision here) and a ChatML
template whose image parts render as `<image>`.

Qwen2-VL / Qwen2.5-VL: `build_tiny_qwen_vl` (dynamic resolution, M-RoPE). On an install
without torchvision the processor is the image-only one of rlhf_dist/models/qwen_vl.py; the
directory is saved as transformers saves the full processor (docs/vision.md).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from rlhf_dist.demo.task import all_words
from rlhf_dist.demo.vision_model import (  # noqa: F401  (the tests' Qwen builders live there)
    QWEN_PIXELS,
    QWEN_TEMPLATE,
    build_qwen_tokenizer,
    build_tiny_qwen_vl,
    tiny_qwen_vl_config,
)

LLAVA_SPECIALS = ("<pad>", "<eos>", "<unk>", "<|im_start|>", "<|im_end|>", "<image>")
# Words of the colour questions `llava_rows` writes (the demo task's words are there too).
LLAVA_WORDS = ("what", "colour", "is", "this", "these", "red", "green", "blue", "and", "none")
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220)}
LLAVA_IMAGE_SIZE = 16
LLAVA_PATCH = 8
# ChatML with content as a string or a list of parts ({"type": "image"} / {"type": "text"}).
LLAVA_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<image> {% else %}{{ p['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def llava_tokenizer(extra_words: tuple[str, ...] = LLAVA_WORDS):  # -> PreTrainedTokenizerFast
    """A word-level tokenizer over the demo task's words, the role names and `extra_words`,
    with LLAVA_SPECIALS and LLAVA_TEMPLATE."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({*all_words(), "system", "user", "assistant", *extra_words})
    vocab = {tok: i for i, tok in enumerate((*LLAVA_SPECIALS, *words))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(list(LLAVA_SPECIALS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="right",
        clean_up_tokenization_spaces=False,
        model_max_length=256,
    )
    tokenizer.chat_template = LLAVA_TEMPLATE
    return tokenizer


def build_tiny_llava(
    out_dir: str | Path, seed: int = 0, extra_words: tuple[str, ...] = LLAVA_WORDS
) -> Path:
    """Random-init LlavaForConditionalGeneration + LlavaProcessor saved (safetensors) to
    `out_dir`; returns it. AutoProcessor and AutoModelForImageTextToText load it back."""
    import torch
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    from rlhf_dist.demo.task import tiny_llama_config

    tokenizer = llava_tokenizer(extra_words)
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    text = tiny_llama_config(len(tokenizer), 0, tokenizer.eos_token_id, tokenizer.eos_token_id)
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=LLAVA_IMAGE_SIZE,
        patch_size=LLAVA_PATCH,
        projection_dim=32,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=image_id,
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
    )
    config.pad_token_id = 0
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    size = {"height": LLAVA_IMAGE_SIZE, "width": LLAVA_IMAGE_SIZE}
    images = CLIPImageProcessorPil(size={"shortest_edge": LLAVA_IMAGE_SIZE}, crop_size=size)
    processor = LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=LLAVA_PATCH,
        vision_feature_select_strategy="default",
        chat_template=LLAVA_TEMPLATE,
        num_additional_image_tokens=1,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    processor.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def llava_colour_reward(completions: list, image: list, **kwargs: object) -> list[float]:
    """A reward reading TRL's `image` keyword (PIL images, one per row): the length of the
    completion's text (TRL's conversational completions: [{"role": "assistant",
    "content": ...}]), signed by whether the image is mostly red. Used by the Python API
    and, as `vision_models:llava_colour_reward`, by the command line."""
    assert len(image) == len(completions) and all(hasattr(im, "getpixel") for im in image)
    red = [im.getpixel((0, 0))[0] > 128 for im in image]
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [len(t) * (1.0 if r else -1.0) for t, r in zip(texts, red)]


def qwen_colour_reward(completions: list, images: list, **kwargs: object) -> list[float]:
    """A reward reading TRL's `images` keyword (each row's list of PIL images, maybe empty):
    the length of the completion's text times 1 + the row's mostly red images, less its
    image count. Used as `vision_models:qwen_colour_reward` by the command line."""
    assert len(images) == len(completions)
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    red = [sum(im.getpixel((0, 0))[0] > 128 for im in row) for row in images]
    return [len(t) * (1.0 + r) - len(row) for t, r, row in zip(texts, red, images)]


def colour_image(name: str, size: tuple[int, int] = (20, 20)):  # -> PIL.Image.Image
    """A plain image of colour `name` (COLOURS) and `size` (width, height)."""
    from PIL import Image

    return Image.new("RGB", size, COLOURS[name])


def llava_rows(n: int, seed: int = 0, kind: str = "sft", scale: int = 1) -> list[dict]:
    """`n` TRL-format vision rows about the colours of 0, 1 or 2 images of mixed sizes:
    kind "sft" (a `messages` list-of-parts conversation, images in `images`), "dpo"
    (string-content `prompt` / `chosen` / `rejected` with the images in `images`: TRL's
    rule places them) or "grpo" (a list-of-parts `prompt`, one `image`, and the colour
    in `answer`). `scale` multiplies the image sizes (Qwen2-VL's processor resizes to at
    least QWEN_PIXELS' minimum: scale 3 gives it grids of several sizes)."""
    import random

    rng, names, rows = random.Random(seed), sorted(COLOURS), []
    for i in range(n):
        count = 1 if kind == "grpo" else i % 3
        picked = [rng.choice(names) for _ in range(count)]
        size = (scale * (16 + 4 * (i % 4)), scale * (16 + 3 * (i % 3)))
        images = [colour_image(c, size) for c in picked]
        answer = " and ".join(picked) or "none"
        question = [{"type": "image"}] * count + [{"type": "text", "text": "what colour is this"}]
        if kind == "sft":
            messages = [
                {"role": "user", "content": question},
                {"role": "assistant", "content": [{"type": "text", "text": answer}]},
            ]
            rows.append({"messages": messages, "images": images})
        elif kind == "dpo":
            wrong = " and ".join(rng.choice([c for c in names if c != p]) for p in picked)
            rows.append({
                "prompt": [{"role": "user", "content": "what colour is this"}],
                "chosen": [{"role": "assistant", "content": answer}],
                "rejected": [{"role": "assistant", "content": wrong or "red"}],
                "images": images,
            })  # fmt: skip
        else:
            rows.append({
                "prompt": [{"role": "user", "content": question}],
                "image": images[0],
                "answer": answer,
            })  # fmt: skip
    return rows


# ---------------------------------------------------------------- Qwen2-VL / Qwen2.5-VL


def qwen_images(sizes: list[tuple[int, int]], seed: int = 0) -> list:
    """PIL RGB images of the given (width, height) sizes, random blocks of colour."""
    from PIL import Image

    rng = random.Random(seed)
    images = []
    for width, height in sizes:
        image = Image.new("RGB", (width, height), tuple(rng.randrange(256) for _ in range(3)))
        for _ in range(4):
            x, y = rng.randrange(width), rng.randrange(height)
            colour = tuple(rng.randrange(256) for _ in range(3))
            image.paste(colour, (x, y, min(width, x + width // 3), min(height, y + height // 3)))
        images.append(image)
    return images


def every_other_word(path: str | Path) -> list[int]:
    """Every other word of the tokenizer as a stop token: a random tiny policy's turns end
    after a token or two, so that most episodes reach the observation."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    special = set(tok.all_special_ids) | {
        tok.convert_tokens_to_ids(t) for t in tok.all_special_tokens
    }
    words = sorted(
        i
        for i in tok.get_vocab().values()
        if i not in special and "<" not in tok.convert_ids_to_tokens(i)
    )
    return words[::2]


class ImageObservation:
    """A two-turn environment whose observation is an image (generation.environment,
    rollout/agent.py): the policy's first turn gets back a tool message holding a colour
    image, as TRL's image part, and a question; its second turn ends the episode. A row
    whose `corrupt` column is true gets bytes no image decoder reads instead."""

    def reset(self, prompt: list[dict], corrupt: bool = False) -> list[dict]:
        self.corrupt = corrupt
        return [dict(m) for m in prompt]

    def step(self, messages: list[dict]) -> tuple[list[dict], bool, None]:
        if sum(m["role"] == "assistant" for m in messages) > 1:
            return [], True, None
        image = b"not an image" if self.corrupt else colour_image("green", (56, 56))
        question = {"type": "text", "text": "what colour is this"}
        return (
            [{"role": "tool", "content": [{"type": "image", "image": image}, question]}],
            False,
            None,
        )


def data_url(image: Any) -> dict:
    """An OpenAI `image_url` part holding `image` as a base64 PNG data URL."""
    import base64
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def image_episode(client: Any, prompt: Any, image: Any) -> None:
    """An environment behind the servers' chat endpoint (generation.environment_endpoint)
    whose observation is an image: the row's image and a question as OpenAI `image_url`
    and text parts, the policy's answer, then a tool message holding a green image and the
    question, and the policy's second answer. No reward: reward.function scores it."""
    question = {"type": "text", "text": "what colour is this"}
    first = [{"role": "user", "content": [data_url(image), question]}]
    reply = client.chat(first)["choices"][0]["message"]
    seen = {"role": "tool", "content": [data_url(colour_image("green", (56, 56))), question]}
    client.chat([*first, reply, seen])


def assert_trained_language_only(before: dict, after: dict) -> None:
    """Two state dicts of a vision-language policy (name -> tensor), before and after
    training with its vision tower frozen: the language model changed, the vision tower and
    projector did not."""
    import torch

    from rlhf_dist.models.vision import is_vision_part

    assert set(before) == set(after)
    vision = [k for k in before if is_vision_part(k)]
    language = [k for k in before if not is_vision_part(k)]
    assert vision and language
    assert all(torch.equal(before[k], after[k]) for k in vision)
    assert any(not torch.equal(before[k], after[k]) for k in language)
