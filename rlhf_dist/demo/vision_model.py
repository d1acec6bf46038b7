"""The tiny Qwen2-VL / Qwen2.5-VL of the vision demo and tests, built from its config with its
processor (dynamic resolution, M-RoPE; docs/vision.md): a word-level ChatML tokenizer over the
vision task's words with Qwen's vision tokens, a 2-layer text model of width 64, a 2-block
vision tower. On an install without torchvision the processor is the image-only one of
models/qwen_vl.py; the directory is saved as transformers saves the full processor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlhf_dist.demo import vision_task

QWEN_SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<unk>",
)
QWEN_WORDS = ("system", "user", "assistant", "a", "an", "image", "and", "two", "images")
# Qwen2-VL's chat template reduced to what the tests need: ChatML turns whose content is a
# string or a list of parts; an image part is <|vision_start|><|image_pad|><|vision_end|>,
# which the processor expands to one pad per merged patch of that image.
QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN_PIXELS = {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 16}  # 4 to 16 image tokens


def build_qwen_tokenizer(save_dir: str | Path | None = None) -> Any:
    """A word-level ChatML tokenizer over the vision task's words, with Qwen's vision tokens
    (pad <|endoftext|>, EOS <|im_end|>, no BOS) and QWEN_TEMPLATE."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({*vision_task.all_words(), *QWEN_WORDS})
    vocab = {tok: i for i, tok in enumerate((*QWEN_SPECIALS, *words))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(list(QWEN_SPECIALS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = QWEN_TEMPLATE
    if save_dir is not None:
        tokenizer.save_pretrained(str(save_dir))
    return tokenizer


def tiny_qwen_vl_config(tokenizer: Any, model_type: str = "qwen2_vl") -> Any:
    """A 2-layer Qwen2-VL (or Qwen2.5-VL) config: text hidden 64 (4 heads of 16, M-RoPE
    sections 2+3+3 = 16/2), a 2-block vision tower of width 32, patch 14, merge 2."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 3, 3],
        },
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": None,
    }
    vision: dict[str, Any] = {
        "depth": 2,
        "num_heads": 2,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    if model_type == "qwen2_vl":
        vision |= {"embed_dim": 32, "hidden_size": 64, "mlp_ratio": 2}
        config_class = Qwen2VLConfig
    else:
        vision |= {
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": 64,
            "window_size": 56,
        }
        vision |= {"fullatt_block_indexes": [1]}
        config_class = Qwen2_5_VLConfig
    ids = {
        name: tokenizer.convert_tokens_to_ids(token)
        for name, token in (
            ("image_token_id", "<|image_pad|>"),
            ("video_token_id", "<|video_pad|>"),
            ("vision_start_token_id", "<|vision_start|>"),
            ("vision_end_token_id", "<|vision_end|>"),
        )
    }
    return config_class(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)


def build_tiny_qwen_vl(save_dir: str | Path, model_type: str = "qwen2_vl", seed: int = 0) -> Path:
    """A tiny Qwen2-VL ("qwen2_vl") or Qwen2.5-VL ("qwen2_5_vl") saved in `save_dir` with its
    processor (image processor + tokenizer + chat template); load it with
    `rlhf_dist.models.qwen_vl.load_processor` and `AutoModelForImageTextToText`."""
    import torch
    from transformers import AutoModelForImageTextToText
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from rlhf_dist.models.qwen_vl import image_only_processor, save_processor

    save_dir = Path(save_dir)
    tokenizer = build_qwen_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(tiny_qwen_vl_config(tokenizer, model_type))
    model.save_pretrained(str(save_dir))
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=14, merge_size=2, temporal_patch_size=2, **QWEN_PIXELS
    )
    processor = image_only_processor(model_type, image_processor, tokenizer, QWEN_TEMPLATE)
    save_processor(processor, save_dir, model_type)
    return save_dir
