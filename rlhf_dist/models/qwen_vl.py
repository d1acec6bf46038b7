"""Qwen2-VL / Qwen2.5-VL processors on an install without torchvision (docs/vision.md,
"Qwen2-VL on CPU without torchvision").

transformers 5.19 builds `Qwen2VLProcessor` from an image processor, a tokenizer AND a video
processor. The video processors need torchvision; without it their class is a placeholder and
the processor's constructor fails on its class check ("VIDEO_PROCESSOR_MAPPING has no attribute
'_extra_content'"), also inside `AutoProcessor.from_pretrained`. The image half has a PIL
implementation (`Qwen2VLImageProcessorPil`) that needs no torchvision.

`load_processor(path)` loads through `AutoProcessor.from_pretrained` first. Only when that fails
for a Qwen-VL model on an install without torchvision does it build the same processor class
without its video half (`image_only_processor`): images and text are processed by transformers'
own code, and a call with videos is refused in one line. The reason is logged once per load.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer
from transformers.models.qwen2_5_vl import Qwen2_5_VLProcessor
from transformers.models.qwen2_vl import Qwen2VLProcessor
from transformers.processing_utils import ProcessorMixin
from transformers.utils import is_torchvision_available

log = logging.getLogger(__name__)

# config.json model_type -> the processor class transformers pairs with it
QWEN_VL_PROCESSORS: dict[str, type[Any]] = {
    "qwen2_vl": Qwen2VLProcessor,
    "qwen2_5_vl": Qwen2_5_VLProcessor,
}


def _image_only_init(
    self: Any,
    image_processor: Any = None,
    tokenizer: Any = None,
    chat_template: Any = None,
    **kwargs: Any,
) -> None:
    """Qwen2VLProcessor.__init__ less the video processor: the same token attributes, and
    ProcessorMixin's checks over the two sub-processors that remain (its `get_attributes`
    reads this signature, so saving and loading see image_processor + tokenizer only)."""
    self.image_token = getattr(tokenizer, "image_token", "<|image_pad|>")
    self.video_token = getattr(tokenizer, "video_token", "<|video_pad|>")
    self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
    self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
    ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)


def _refuse_videos(self: Any, *args: Any, videos: Any = None, **kwargs: Any) -> Any:
    """The processor's own __call__, with videos refused: there is no video processor."""
    if videos is not None:
        raise ValueError(f"{type(self).__name__}: videos need torchvision, which is not installed")
    return super(type(self), self).__call__(*args, **kwargs)


def image_only_class(base: type[Any]) -> type[Any]:
    """`base` (a Qwen-VL processor class) without its video half, as a subclass."""
    namespace = {"__init__": _image_only_init, "__call__": _refuse_videos, "__module__": __name__}
    return type(f"{base.__name__}ImageOnly", (base,), namespace)


IMAGE_ONLY = {model_type: image_only_class(base) for model_type, base in QWEN_VL_PROCESSORS.items()}


def image_only_processor(
    model_type: str, image_processor: Any, tokenizer: Any, chat_template: str
) -> Any:
    """A Qwen-VL processor of `model_type` from its image processor and tokenizer, no videos."""
    if model_type not in IMAGE_ONLY:
        raise ValueError(
            f"no image-only processor for model_type {model_type!r} (have {sorted(IMAGE_ONLY)})"
        )
    return IMAGE_ONLY[model_type](image_processor, tokenizer, chat_template=chat_template)


def _model_type(path: Path) -> str | None:
    config = path / "config.json"
    return json.loads(config.read_text()).get("model_type") if config.is_file() else None


def load_processor(path: str | Path) -> Any:
    """The processor saved in `path`: `AutoProcessor.from_pretrained(path)`, or, for a Qwen-VL
    model on an install without torchvision, the same processor without its video half built
    from the saved image processor, tokenizer and chat template (the reason is logged)."""
    path = Path(path)
    model_type = _model_type(path)
    try:
        return AutoProcessor.from_pretrained(str(path))
    except Exception as error:  # the placeholder video class fails in several ways
        if model_type not in IMAGE_ONLY or is_torchvision_available():
            raise
        reason = f"{type(error).__name__}: {' '.join(str(error).split())[:160]}"
    log.warning(
        "%s: AutoProcessor failed without torchvision (%s); using %s (images and text, no videos)",
        path, reason, IMAGE_ONLY[model_type].__name__,
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    image_processor = AutoImageProcessor.from_pretrained(str(path))
    return image_only_processor(model_type, image_processor, tokenizer, tokenizer.chat_template)


def save_any(processor: Any, path: str | Path) -> None:
    """Save a loaded processor: an image-only Qwen-VL one as `save_processor` does (so the
    directory names the real class), any other through its own save_pretrained."""
    for model_type, cls in IMAGE_ONLY.items():
        if type(processor) is cls:
            save_processor(processor, path, model_type)
            return
    processor.save_pretrained(str(path))


def save_processor(processor: Any, path: str | Path, model_type: str) -> None:
    """Save `processor` as transformers saves the full one: the processor class recorded is the
    real Qwen-VL class and processor_config.json gets the video processor's entry (the image
    processor's settings under `Qwen2VLVideoProcessor`, the class transformers pairs with both
    Qwen2-VL and Qwen2.5-VL), so an install with torchvision loads the directory through
    `AutoProcessor` as usual; `load_processor` reads it on either install."""
    path = Path(path)
    processor.save_pretrained(str(path))
    real = QWEN_VL_PROCESSORS[model_type].__name__
    for name in ("processor_config.json", "tokenizer_config.json"):
        file = path / name
        if file.is_file():
            data = json.loads(file.read_text())
            if "processor_class" in data:
                data["processor_class"] = real
            if "image_processor" in data:
                video = {
                    k: v for k, v in data["image_processor"].items() if k != "image_processor_type"
                }
                data["video_processor"] = {**video, "video_processor_type": "Qwen2VLVideoProcessor"}
            file.write_text(json.dumps(data, indent=2) + "\n")
