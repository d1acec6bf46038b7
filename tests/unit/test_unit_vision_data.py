"""Images in data rows (rlhf_dist/data/vision.py): TRL's image formats, the placeholders
of messages, the expansion into the processor's image tokens, per-row pixel inputs, and
cutting a response before a sampled image token (engine/decode.py `cut_before`)."""

from __future__ import annotations

import io
import random

import pytest
import torch
from PIL import Image

from rlhf_dist.data.chat import BadRow
from rlhf_dist.data.vision import (
    RowMedia,
    flatten_messages,
    join_media,
    load_image,
    row_images,
    token_inputs,
)
from rlhf_dist.engine.decode import cut_before

RED = (220, 30, 30)


def png_bytes(colour: tuple[int, int, int] = RED) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (5, 4), colour).save(buf, format="PNG")
    return buf.getvalue()


def test_every_image_form_trl_reads_loads_as_the_same_rgb_image(tmp_path):
    path = tmp_path / "red.png"
    path.write_bytes(png_bytes())
    forms = [
        Image.new("RGBA", (5, 4), (*RED, 255)),
        str(path),
        png_bytes(),
        {"bytes": png_bytes(), "path": None},  # datasets.Image's storage
        {"bytes": None, "path": str(path)},
    ]
    for form in forms:
        image = load_image(form)
        assert image.mode == "RGB" and image.size == (5, 4)
        assert image.getpixel((0, 0)) == RED


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("/no/such/image.png", "image file not found"),
        (b"not an image at all", "unreadable image"),
        (3, "image not a PIL image, path or bytes"),
    ],
)
def test_a_bad_image_is_a_skip_with_its_reason(value, reason):
    with pytest.raises(BadRow, match=reason):
        load_image(value)


def test_row_images_reads_image_or_images_in_order():
    a, b = png_bytes(RED), png_bytes((0, 0, 255))
    assert len(row_images({"image": a})) == 1
    got = row_images({"images": [a, b], "image": None})
    assert [im.getpixel((0, 0)) for im in got] == [RED, (0, 0, 255)]
    assert row_images({"prompt": "x"}) == []
    with pytest.raises(BadRow, match="'images' not a list"):
        row_images({"images": a})


def test_string_contents_get_the_images_before_the_first_user_text_as_trl_does():
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "what colour"},
        {"role": "assistant", "content": "red"},
        {"role": "user", "content": "and now"},
    ]
    out = flatten_messages(messages, 2, "<image>", "prompt")
    assert [m["content"] for m in out] == [
        "be brief",
        "<image><image>what colour",
        "red",
        "and now",
    ]
    assert flatten_messages(messages, 0, "<image>", "prompt") == messages


def test_list_of_parts_become_text_with_a_placeholder_per_image_part():
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "compare "},
                {"type": "image"},
                {"type": "text", "text": " with "},
                {"type": "image"},
            ],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "same"}]},
    ]
    out = flatten_messages(messages, 2, "<I>", "messages")
    assert out[0]["content"] == "compare <I> with <I>" and out[1]["content"] == "same"
    with pytest.raises(
        BadRow, match="image count differs from the image placeholders in 'messages'"
    ):
        flatten_messages(messages, 1, "<I>", "messages")
    bad = [{"role": "user", "content": [{"type": "video"}]}]
    with pytest.raises(BadRow, match="neither text nor image"):
        flatten_messages(bad, 0, "<I>", "prompt")


def test_rows_join_their_pixel_inputs_in_row_order_and_select_like_tensors():
    rows = (
        {"pixel_values": torch.full((1, 3), 1.0)},
        None,  # a row without images
        {"pixel_values": torch.full((2, 3), 2.0)},
    )
    media = RowMedia(rows, image_token_id=7)
    joined = media.joined()
    assert joined is not None and joined["pixel_values"][:, 0].tolist() == [1.0, 2.0, 2.0]
    picked = media[torch.tensor([2, 0])].joined()
    assert picked is not None and picked["pixel_values"][:, 0].tolist() == [2.0, 2.0, 1.0]
    assert media[torch.tensor([False, True, False])].joined() is None
    assert len(RowMedia.cat([media[1:], media[:1]])) == 3
    assert join_media([None, None]) == {}


def test_cut_before_by_hand():
    ids = torch.tensor([[4, 9, 5, 2], [4, 2, 0, 0], [9, 4, 4, 4]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    finished = torch.tensor([True, True, False])
    out, out_mask, out_finished = cut_before(ids, mask, finished, token_id=9, pad_id=0)
    assert out.tolist() == [[4, 0, 0, 0], [4, 2, 0, 0], [0, 0, 0, 0]]
    assert out_mask.int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]]
    assert out_finished.tolist() == [False, True, False]


def test_cut_before_property_keeps_a_prefix_without_the_token():
    rng = random.Random(0)
    for _ in range(50):
        B, T = rng.randint(1, 4), rng.randint(1, 6)
        ids = torch.randint(0, 4, (B, T))
        lengths = torch.randint(0, T + 1, (B,))
        mask = torch.arange(T)[None, :] < lengths[:, None]
        finished = torch.rand(B) < 0.5
        out, out_mask, out_finished = cut_before(ids, mask, finished, token_id=3, pad_id=0)
        assert not bool(((out == 3) & out_mask).any())  # no image token is kept
        assert bool((out_mask <= mask).all())  # nothing is added
        assert bool((out[out_mask] == ids[out_mask]).all())  # what is kept is unchanged
        kept = out_mask.sum(1)
        assert bool((out_mask == (torch.arange(T)[None, :] < kept[:, None])).all())  # a prefix
        assert bool((out_finished <= finished).all())


def test_a_per_token_input_is_built_for_each_forwards_ids():
    """Qwen2-VL's mm_token_type_ids / Gemma 3's token_type_ids: carried as the image
    token's id (0-dim), 1 where a forward's ids hold it, whatever the padding."""
    rows = [
        {"pixel_values": torch.ones(1, 2), "mm_token_type_ids": torch.tensor(7)},
        {"pixel_values": torch.zeros(2, 2), "mm_token_type_ids": torch.tensor(7)},
    ]
    joined = join_media(rows)
    assert joined["mm_token_type_ids"].dim() == 0 and joined["pixel_values"].shape == (3, 2)
    ids = torch.tensor([[0, 7, 7, 3], [7, 3, 7, 0]])
    inputs = token_inputs(ids, joined)
    assert inputs["mm_token_type_ids"].tolist() == [[0, 1, 1, 0], [1, 0, 1, 0]]
    assert inputs["pixel_values"] is joined["pixel_values"]
