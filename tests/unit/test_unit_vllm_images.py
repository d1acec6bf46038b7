"""The pieces of vLLM's image path that need no engine (generation/vllm_images.py): each
image's tokens collapsed to the one placeholder vLLM expands itself, the requests built
from left-padded prompts and their images, and the checkpoint names vLLM reads."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from rlhf_dist.data.vision import RowMedia
from rlhf_dist.generation.vllm_images import collapse_images, image_requests, vllm_name

IMG = 9  # the image token


def test_collapse_by_hand():
    # two images apart (text between): one run each, of any lengths
    assert collapse_images([1, IMG, IMG, IMG, 2, IMG, IMG, 3], IMG, 2) == [1, IMG, 2, IMG, 3]
    # two adjacent images of 3 tokens each: one run of 6 split evenly
    assert collapse_images([1, IMG, IMG, IMG, IMG, IMG, IMG, 2], IMG, 2) == [1, IMG, IMG, 2]
    assert collapse_images([1, 2], IMG, 0) == [1, 2]
    with pytest.raises(ValueError, match="do not split into 2 images"):
        collapse_images([1, IMG, IMG, IMG, 2], IMG, 2)


def test_collapse_inverts_a_fixed_count_expansion():
    """Property: expanding each placeholder of a prompt to k image tokens (LLaVA's rule)
    and collapsing gives the prompt back, for any placement of 0 to 4 images."""
    rng = random.Random(0)
    for _ in range(200):
        prompt = [rng.choice([1, 2, 3, IMG]) for _ in range(rng.randrange(1, 12))]
        k = rng.randrange(1, 6)
        expanded = [t for tok in prompt for t in ([IMG] * k if tok == IMG else [tok])]
        assert collapse_images(expanded, IMG, prompt.count(IMG)) == prompt


def test_image_requests_take_real_tokens_and_each_rows_images():
    ids = torch.tensor([[0, 0, 1, IMG, IMG, 2], [0, 5, 6, 7, 8, 4]])
    mask = (ids != 0).long()
    picture = object()
    media = RowMedia(({"pixel_values": torch.zeros(1)}, None), IMG, ((picture,), ()))
    first, second = image_requests(ids, mask, media)
    assert first == {"prompt_token_ids": [1, IMG, 2], "multi_modal_data": {"image": [picture]}}
    assert second == {"prompt_token_ids": [5, 6, 7, 8, 4]}
    with pytest.raises(ValueError, match="decoded images were not kept"):
        image_requests(ids, mask, RowMedia(media.rows, IMG))


def test_rowmedia_keeps_each_rows_images_through_selection_and_cat():
    media = RowMedia((None, None, None), IMG, (("a",), (), ("b", "c")))
    assert media[torch.tensor([2, 0])].images == (("b", "c"), ("a",))
    assert media[torch.tensor([False, True, True])].images == ((), ("b", "c"))
    assert RowMedia.cat([media[0:1], media[2:3]]).images == (("a",), ("b", "c"))
    assert RowMedia.cat([media, RowMedia((None,), IMG)]).images == ()  # not kept by one part


def test_vllm_names_of_a_clip_tower():
    clip = SimpleNamespace(vision_config=SimpleNamespace(model_type="clip_vision_model"))
    other = SimpleNamespace(vision_config=SimpleNamespace(model_type="siglip_vision_model"))
    name = "model.vision_tower.encoder.layers.0.mlp.fc1.weight"
    assert (
        vllm_name(name, clip) == "model.vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight"
    )
    assert vllm_name(vllm_name(name, clip), clip) == vllm_name(name, clip)  # once only
    assert vllm_name(name, other) == name
    assert vllm_name("model.language_model.norm.weight", clip) == "model.language_model.norm.weight"
