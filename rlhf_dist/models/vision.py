"""Vision-language policies (docs/vision.md): recognising one by its config, loading it
through transformers' image-text-to-text auto classes with its processor, and freezing
its vision tower and projector (`model.freeze_vision`).

A family is recognised by its config class alone (transformers' image-text-to-text
mapping: LLaVA, Qwen2/2.5/3-VL, Idefics3/SmolVLM, Gemma 3, ...), so a family transformers
ships needs no code here; what differs per family is what its processor returns, which
the data side carries generically (data/vision.py).
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from rlhf_dist.config import Config
from rlhf_dist.data.vision import Media, VisionInputs, vision_inputs
from rlhf_dist.distributed import zero3
from rlhf_dist.errors import ConfigError

# Names the vision encoder and the projector into the language model's embedding space go
# by in transformers' vision-language models: LLaVA and Gemma 3 (vision_tower,
# multi_modal_projector), Qwen2/2.5/3-VL (visual, its merger inside), Idefics3 and SmolVLM
# (vision_model, connector).
VISION_MODULES = ("vision_tower", "multi_modal_projector", "visual", "vision_model", "connector")


def vision_config(path: str, trust_remote_code: bool = False) -> Any | None:
    """The transformers config at `path` when it is a vision-language model's (its class
    is in the image-text-to-text auto mapping), else None. An unreadable config is None:
    the causal-LM loader then reports it as it does for text models."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    if not path:
        return None
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return None
    return config if config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES else None


def is_vision_part(name: str) -> bool:
    """Whether parameter or module `name` (dotted) lies in a vision tower or projector."""
    return any(part in VISION_MODULES for part in name.split("."))


def freeze_vision(model: nn.Module) -> nn.Module:
    """`model` with every parameter of its vision tower and projector frozen (requires_grad
    False): the optimizer takes trainable parameters only (trainers/common.py), so they are
    never updated. A model with no such parameter is a ConfigError: freezing nothing would
    train what model.freeze_vision promised to keep."""
    frozen = 0
    for name, p in model.named_parameters():
        if is_vision_part(name):
            p.requires_grad_(False)
            frozen += 1
    if frozen == 0:
        raise ConfigError(
            f"model.freeze_vision: no vision tower or projector found in {type(model).__name__} "
            f"(looked for modules named {', '.join(VISION_MODULES)})"
        )
    return model


def keep_tower_in_step(model: nn.Module, path: str, trust_remote_code: bool = False) -> None:
    """Under ZeRO-3's per-module fetching or FSDP2's per-unit gathers, every rank runs the vision tower of `model` (a
    vision-language model loaded from `path`) in each forward where any rank's rows hold
    images: a rank without runs a blank image through it (distributed/zero3.py
    `tower_in_step`). On one process, or with the weights whole, nothing changes."""
    inner = getattr(model, model.base_model_prefix)
    blank = functools.partial(_blank_features, path, trust_remote_code)
    zero3.tower_in_step(inner, blank, is_vision_part)


def _blank_features(path: str, trust_remote_code: bool, model: nn.Module) -> Any:
    """The features of one blank image through `model`'s tower and projector
    (`get_image_features`' pooled output, with the pixel inputs the processor at `path`
    makes of it)."""
    device = next(model.parameters()).device
    media = _blank_media(path, trust_remote_code)
    inputs = {k: v.to(device) for k, v in media.items() if v.dim() > 0}  # per image only
    out = model.get_image_features(**inputs, return_dict=True)
    # the features the model scatters into its embeddings (the tower's last hidden states
    # before the merger would add a backward path the ranks with images do not take)
    return getattr(out, "pooler_output", out)


@functools.cache
def _blank_media(path: str, trust_remote_code: bool) -> Media:
    """The pixel inputs of a black 56 x 56 image (Qwen-VL's smallest grid, 2 x 2 merged
    patches; fixed-size families resize it) by the processor at `path`."""
    from PIL import Image

    vision = vision_inputs(load_processor(path, trust_remote_code), "model.policy")
    return vision.image_tokens(Image.new("RGB", (56, 56)))[1]


def language_model_modules(model: nn.Module, targets: tuple[str, ...]) -> list[str]:
    """Full names of the modules of `model` whose last name part is in `targets`, outside
    the vision tower and projector: LoRA's default targets (q_proj, ...) also name the
    CLIP and SigLIP attention layers, which must stay as they are."""
    return [
        name
        for name, _ in model.named_modules()
        if name.split(".")[-1] in targets and not is_vision_part(name)
    ]


def load_processor(path: str, trust_remote_code: bool = False, key: str = "model.policy") -> Any:
    """The processor saved with a vision-language model at `path`: its
    image processor turns images into the model's pixel inputs and says how many tokens
    each image takes. Loaded through models/qwen_vl.py's `load_processor` (AutoProcessor,
    or a Qwen-VL processor without its video half on an install without torchvision);
    with trust_remote_code, AutoProcessor directly. A missing or unusable processor is one
    line naming `key`."""
    from transformers import AutoProcessor

    from rlhf_dist.models import qwen_vl

    try:
        if trust_remote_code:
            processor = AutoProcessor.from_pretrained(path, trust_remote_code=True)
        else:
            processor = qwen_vl.load_processor(path)
    except (OSError, ValueError, AttributeError, ImportError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"{key}: cannot load the processor of {path!r}: {first}") from None
    if getattr(processor, "image_processor", None) is None:
        raise ConfigError(f"{key}: the processor at {path!r} has no image processor")
    return processor


def policy_vision(cfg: Config, samples: bool = False) -> VisionInputs | None:
    """The VisionInputs of model.policy when it is a vision-language model, else None (a
    text run). What does not work with images yet is refused here, before any data or
    weights load: perf.packed_sequences (packed rows would need each image's features
    at the packed positions) and sequence parallelism (an image's tokens must stay on
    one rank); for a stage that `samples`, vLLM for other families than LLaVA's (the
    only one vLLM imports without torchvision, generation/vllm_images.py) and with
    debug.check_vllm_sync (whose greedy decode loop takes no images), and rollout servers
    one step off-policy (tools and environments may return images: rollout/agent.py,
    rollout/endpoint.py)."""
    m, g, key = cfg.model, cfg.generation, "model.policy"
    path = m.policy
    config = vision_config(path, m.trust_remote_code)
    if config is None:
        return None
    if samples and g.backend == "vllm":
        _refuse_for_vllm(cfg, config.model_type)
    if samples and g.backend == "server" and cfg.ppo.max_staleness:
        raise ConfigError(
            "ppo.max_staleness: a vision-language policy's served rollouts are on-policy (0)"
        )
    if cfg.perf.packed_sequences:
        raise ConfigError("perf.packed_sequences: not supported for a vision-language policy")
    if cfg.distributed.sequence_parallel_size > 1:
        raise ConfigError(
            "distributed.sequence_parallel_size: not supported for a vision-language policy"
        )
    processor = load_processor(path, m.trust_remote_code, key)
    return vision_inputs(processor, key)


def _refuse_for_vllm(cfg: Config, model_type: str) -> None:
    """generation.backend=vllm with a vision-language policy: LLaVA-style ones only, and
    without debug.check_vllm_sync (its greedy decode loop takes no images)."""
    if model_type != "llava":
        raise ConfigError(
            f"generation.backend: vLLM samples images for LLaVA-style policies only, not "
            f"{model_type!r} (use hf or server)"
        )
    if cfg.debug.check_vllm_sync:
        raise ConfigError("debug.check_vllm_sync: not supported for a vision-language policy")
