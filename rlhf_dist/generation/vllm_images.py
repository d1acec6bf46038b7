"""Images through the in-process vLLM engine (generation.backend=vllm, docs/vision.md
"vLLM"): a vision-language policy's prompts go to vLLM as token ids with their decoded
images in `multi_modal_data`, and vLLM's own copy of the processor and vision tower
makes the image features.

Three differences from a text engine, each because of how vLLM 0.32 reads a model:

- the prompt holds ONE placeholder per image: vLLM's LLaVA processor expands each
  `<image>` token itself (to the processor's count), so a prompt whose images are
  already expanded (ours, data/vision.py) would get them twice (`collapse_images`);
- the checkpoint names vLLM loads are those of the checkpoints on the Hub: transformers
  5 drops CLIPVisionModel's `vision_model.` prefix in memory and when saving
  (transformers conversion_mapping "CLIPVisionModel"), vLLM's CLIP keeps it
  (`vllm_name`);
- vLLM's LLaVA module imports transformers' Pixtral image processor, whose module needs
  torchvision for one helper that transformers ships again in its PIL module
  (`register_llava_without_torchvision`).

Only LLaVA-style policies are sampled this way (models/vision.py refuses the others): on
an install without torchvision vLLM cannot import its Qwen2-VL, Qwen2.5-VL or Gemma 3
modules at all.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any

import torch

from rlhf_dist.data.vision import RowMedia

# transformers' torchvision module vLLM's llava.py imports (through its pixtral.py) for
# `_num_image_tokens`, and the PIL module that defines the same function.
_PIXTRAL = "transformers.models.pixtral.image_processing_pixtral"
_PIXTRAL_PIL = "transformers.models.pixtral.image_processing_pil_pixtral"
_CLIP_TOWER = "model.vision_tower."


def register_llava_without_torchvision(vllm: Any) -> None:
    """Make vLLM's LLaVA importable where torchvision is not installed (a no-op where it
    is): the Pixtral module name resolves to transformers' PIL twin, and vLLM's LLaVA
    class is registered from this process (vLLM otherwise inspects it in a fresh Python
    process, which would not see the alias)."""
    if importlib.util.find_spec("torchvision") is not None:
        return
    sys.modules.setdefault(_PIXTRAL, importlib.import_module(_PIXTRAL_PIL))
    from vllm.model_executor.models.llava import LlavaForConditionalGeneration

    vllm.ModelRegistry.register_model(
        "LlavaForConditionalGeneration", LlavaForConditionalGeneration
    )


def vllm_name(name: str, config: Any) -> str:
    """The checkpoint name vLLM's loader reads for our parameter `name` of a
    vision-language model with `config`: a CLIP tower's parameters get back the
    `vision_model.` prefix transformers 5 removes; every other name is as it is."""
    vision = getattr(config, "vision_config", None)
    clip = getattr(vision, "model_type", None) == "clip_vision_model"
    if clip and name.startswith(_CLIP_TOWER) and ".vision_model." not in name:
        return _CLIP_TOWER + "vision_model." + name[len(_CLIP_TOWER) :]
    return name


def collapse_images(ids: list[int], image_token_id: int, n_images: int) -> list[int]:
    """`ids` (one prompt's real tokens) with each image's run of `image_token_id` tokens
    cut to one. Images apart from each other (text or delimiters between them) are one
    run each; adjacent images share a run, which then splits evenly (a fixed count per
    image, LLaVA's). A count that does not divide is a ValueError."""
    runs: list[tuple[int, int]] = []  # (start, length) of each run
    for t, token in enumerate(ids):
        if token != image_token_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == t:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((t, 1))
    total = sum(n for _, n in runs)
    if len(runs) == n_images:
        per_run = [1] * n_images
    elif n_images and total % n_images == 0 and all(n % (total // n_images) == 0 for _, n in runs):
        per_run = [n // (total // n_images) for _, n in runs]
    else:
        raise ValueError(
            f"{total} image tokens in {len(runs)} runs do not split into {n_images} images"
        )
    out, start = [], 0
    for (at, n), k in zip(runs, per_run):
        out += ids[start:at] + [image_token_id] * k
        start = at + n
    return out + ids[start:]


def image_requests(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, media: RowMedia
) -> list[dict]:
    """Left-padded (B, P) prompts and their rows' images -> B vLLM requests: the real
    tokens with each image collapsed to its placeholder (`collapse_images`), and the
    decoded images as `multi_modal_data` (none for a row without images)."""
    if len(media.images) != prompt_ids.shape[0]:
        raise ValueError("generation.backend=vllm: the prompts' decoded images were not kept")
    requests = []
    for row, mask, images in zip(prompt_ids, prompt_mask, media.images):
        ids = row[mask.bool()].tolist()
        if not images:
            requests.append({"prompt_token_ids": ids})
            continue
        ids = collapse_images(ids, media.image_token_id, len(images))
        requests.append({"prompt_token_ids": ids, "multi_modal_data": {"image": list(images)}})
    return requests
