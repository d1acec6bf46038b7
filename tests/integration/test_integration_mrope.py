"""M-RoPE positions (rlhf_dist/engine/positions.py) against transformers' own `get_rope_index`
and a KV-cache decode against one full forward, on tiny Qwen2-VL and Qwen2.5-VL models saved
with their processors (tests/vision_models.py), and the torchvision-less processor fallback
(rlhf_dist/models/qwen_vl.py)."""

from __future__ import annotations

import json
import logging
import random

import pytest
import torch
from vision_models import build_tiny_qwen_vl, qwen_images

from rlhf_dist.engine.positions import (
    cached_mrope_logprobs,
    mrope_extend,
    mrope_ids_of,
    mrope_next_positions,
    mrope_positions,
)
from rlhf_dist.models.qwen_vl import load_processor

MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")
IMG = 9  # the image token id of the hand cases


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """model_type -> (model in eval mode, processor), each built and saved once."""
    from transformers import AutoModelForImageTextToText

    out = {}
    for model_type in MODEL_TYPES:
        path = build_tiny_qwen_vl(tmp_path_factory.mktemp(model_type), model_type)
        model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32).eval()
        out[model_type] = (model, load_processor(path), path)
    return out


def test_hand_case_one_image_left_padded():
    """[pad pad a b IMG x4 c d], grid (1, 4, 4) merged 2 -> 2 x 2 tokens at s = 2."""
    ids = torch.tensor([[0, 0, 5, 6, IMG, IMG, IMG, IMG, 7, 8]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1]])
    positions, deltas = mrope_positions(ids, mask, torch.tensor([[1, 4, 4]]), IMG, 2)
    assert positions[:, 0].tolist() == [
        [0, 0, 0, 1, 2, 2, 2, 2, 4, 5],  # temporal: the image's t = 0 at s
        [0, 0, 0, 1, 2, 2, 3, 3, 4, 5],  # height: rows 0, 0, 1, 1
        [0, 0, 0, 1, 2, 3, 2, 3, 4, 5],  # width: columns 0, 1, 0, 1
    ]
    assert deltas.tolist() == [[6 - 8]]  # max id 5 + 1 - 8 real tokens
    # the decode step after it: 9 real tokens so far (8 + the fed one) -> 8 + delta = 6
    step = mrope_next_positions(torch.cat([mask, torch.ones(1, 1, dtype=torch.long)], 1), deltas)
    assert step.tolist() == [[[6]], [[6]], [[6]]]
    extended = mrope_extend(positions, mask, deltas, 2)
    assert extended[:, 0, -2:].tolist() == [[6, 7]] * 3


def test_text_only_rows_are_plain_positions():
    ids = torch.tensor([[0, 5, 6, 7], [5, 6, 7, 8]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    positions, deltas = mrope_positions(ids, mask, None, IMG, 2)
    assert positions[0].tolist() == [[0, 0, 1, 2], [0, 1, 2, 3]]
    assert deltas.tolist() == [[0], [0]]


@pytest.mark.parametrize(
    "ids, grid, message",
    [
        ([5, IMG, IMG, IMG], [[1, 4, 4]], "needs 4 image tokens"),
        ([5, IMG, IMG, IMG, IMG], [], "more image tokens"),
        ([5, IMG, IMG, IMG, IMG], [[1, 4, 4], [1, 4, 4]], "more images"),
    ],
)
def test_tokens_and_grids_that_disagree_are_refused(ids, grid, message):
    grid_thw = torch.tensor(grid, dtype=torch.long).reshape(-1, 3)
    with pytest.raises(ValueError, match=message):
        mrope_positions(torch.tensor([ids]), torch.ones(1, len(ids)), grid_thw, IMG, 2)


def _batch(processor, rng: random.Random, n_images: list[int]):
    """Processor outputs for rows with these image counts, left-padded, sizes drawn by rng."""
    sizes = [(28 * rng.randint(2, 4), 28 * rng.randint(2, 4)) for _ in range(sum(n_images))]
    images = iter(qwen_images(sizes, seed=rng.randrange(1000)))
    texts, row_images = [], []
    for n in n_images:
        words = " ".join(
            rng.choice(["red", "blue", "what", "is", "the"]) for _ in range(rng.randint(1, 6))
        )
        content = [{"type": "image"}] * n + [{"type": "text", "text": words}]
        chat = [{"role": "user", "content": content}]
        texts.append(
            processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        )
        row_images.append([next(images) for _ in range(n)])
    kwargs = {"images": row_images} if sum(n_images) else {}
    return processor(text=texts, padding=True, return_tensors="pt", **kwargs)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_positions_equal_get_rope_index(qwen, model_type):
    """Random left-padded batches mixing rows of 0, 1 and 2 images of different sizes: the
    prompt's ids and deltas, and prompt + response ids, equal transformers' get_rope_index."""
    model, processor, _ = qwen[model_type]
    image_token_id, merge = mrope_ids_of(model.config)
    rng = random.Random(0)
    for n_images in ([0, 1, 2], [2, 0], [1, 1, 2, 0], [0, 0]):
        batch = _batch(processor, rng, n_images)
        grid = batch.get("image_grid_thw")
        ids, mask, types = batch["input_ids"], batch["attention_mask"], batch["mm_token_type_ids"]
        ours, deltas = mrope_positions(ids, mask, grid, image_token_id, merge)
        if grid is None:  # text only: the model's own rule, positions counted over real tokens
            expected = (mask.cumsum(-1) - 1).clamp(min=0).expand(3, -1, -1)
            assert torch.equal(ours, expected) and not deltas.any()
            continue
        theirs, their_deltas = model.model.get_rope_index(ids, types, grid, attention_mask=mask)
        assert torch.equal(ours, theirs) and torch.equal(deltas, their_deltas.reshape(-1, 1))
        full_ids = torch.cat([ids, torch.full((len(ids), 3), 5)], dim=1)
        full_mask = torch.cat([mask, torch.ones(len(ids), 3, dtype=mask.dtype)], dim=1)
        full_types = torch.cat([types, torch.zeros(len(ids), 3, dtype=types.dtype)], dim=1)
        theirs, _ = model.model.get_rope_index(full_ids, full_types, grid, attention_mask=full_mask)
        assert torch.equal(mrope_extend(ours, mask, deltas, 3), theirs)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_cached_decode_logprobs_equal_full_forward(qwen, model_type):
    """Prefill + KV-cache steps with our positions give the log-probs of one full forward over
    prompt + response (the model's own positions) to 1e-4 in fp32, rows of 0, 1 and 2 images."""
    model, processor, _ = qwen[model_type]
    batch = _batch(processor, random.Random(1), [1, 0, 2])
    response = torch.randint(
        8, len(processor.tokenizer), (3, 5), generator=torch.Generator().manual_seed(0)
    )
    cached = cached_mrope_logprobs(model, batch, response)
    n = response.shape[1]
    with torch.no_grad():
        full = model(
            input_ids=torch.cat([batch["input_ids"], response], 1),
            attention_mask=torch.cat([batch["attention_mask"], torch.ones_like(response)], 1),
            mm_token_type_ids=torch.cat(
                [batch["mm_token_type_ids"], torch.zeros_like(response)], 1
            ),
            pixel_values=batch["pixel_values"],
            image_grid_thw=batch["image_grid_thw"],
        ).logits[:, -n - 1 : -1]
    expected = torch.log_softmax(full.float(), -1).gather(-1, response.unsqueeze(-1)).squeeze(-1)
    assert cached.shape == (3, n)
    assert (cached - expected).abs().max().item() < 1e-4
    # the positions matter: plain 1-D positions in the prefill give other log-probs
    model.model.rope_deltas = None
    with torch.no_grad():
        plain = model(**{k: batch[k] for k in ("input_ids", "attention_mask", "pixel_values", "image_grid_thw")},
                      position_ids=(batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)).logits[:, -1]  # fmt: skip
    first = torch.log_softmax(plain.float(), -1).gather(-1, response[:, :1]).squeeze(-1)
    assert (first[[0, 2]] - cached[[0, 2], 0]).abs().max().item() > 1e-4


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_processor_without_torchvision(qwen, model_type, caplog):
    """The saved directory names the real processor class and a video processor entry; here,
    without torchvision, load_processor logs why and gives the image-only processor, whose
    outputs are the real processor's (image pads expanded per merged patch); videos refused."""
    from transformers.utils import is_torchvision_available

    _, processor, path = qwen[model_type]
    config = json.loads((path / "processor_config.json").read_text())
    assert config["processor_class"] in ("Qwen2VLProcessor", "Qwen2_5_VLProcessor")
    assert config["video_processor"]["video_processor_type"] == "Qwen2VLVideoProcessor"
    if is_torchvision_available():
        pytest.skip("torchvision is installed: AutoProcessor loads the full processor")
    with caplog.at_level(logging.WARNING, logger="rlhf_dist.models.qwen_vl"):
        again = load_processor(path)
    assert "without torchvision" in caplog.text and "ImageOnly" in type(again).__name__
    image = qwen_images([(56, 84)])[0]
    batch = again(
        text=["<|vision_start|><|image_pad|><|vision_end|> red"],
        images=[image],
        return_tensors="pt",
    )
    assert batch["image_grid_thw"].tolist() == [[1, 6, 4]]
    assert (batch["input_ids"] == again.image_token_id).sum().item() == 6 * 4 // 4
    with pytest.raises(ValueError, match="videos need torchvision"):
        again(text=["red"], videos=[[image]])
