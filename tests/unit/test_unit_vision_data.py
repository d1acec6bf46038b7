"""Images in data rows (rlhf_dist/data/vision.py): TRL's image formats, the placeholders
of messages (and of an episode's observations, `message_images`), the expansion into the processor's image tokens, per-row pixel inputs, and
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
    message_images,
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
    assert inputs["pixel_values"] is joined["pixel_values"]  # on the ids' device already
    # ids on another device (a GPU's; "meta" here): the host-made pixel inputs follow them
    on_meta = token_inputs(ids.to("meta"), joined)
    assert {v.device.type for v in on_meta.values()} == {"meta"}


def test_episode_messages_give_their_images_in_the_order_of_their_placeholders():
    """`message_images` by hand: a prompt's placeholder text and an image part without an
    image take the row's given images in order; parts carrying an image (TRL's, an OpenAI
    data URL) give theirs, each where it stands."""
    import base64

    colours = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (9, 9, 9)]
    given = [Image.new("RGB", (3, 3), c) for c in colours[:2]]
    url = "data:image/png;base64," + base64.b64encode(png_bytes(colours[3])).decode()
    messages = [
        {"role": "user", "content": "<I>what is this"},
        {"role": "assistant", "content": "look"},
        {"role": "tool", "content": [
            {"type": "image", "image": Image.new("RGB", (3, 3), colours[2])},
            {"type": "text", "text": "and"},
            {"type": "image"},
            {"type": "image_url", "image_url": {"url": url}},
        ]},
    ]  # fmt: skip
    out, images = message_images(messages, "<I>", given)
    assert [m["content"] for m in out] == ["<I>what is this", "look", "<I>and<I><I>"]
    assert [m["role"] for m in out] == ["user", "assistant", "tool"]
    assert [im.getpixel((0, 0)) for im in images] == [colours[i] for i in (0, 2, 1, 3)]


def test_episode_messages_property_images_match_placeholders():
    """Random messages of text and image parts: one image per placeholder in the output,
    in order, whichever form each came in; no image at all leaves every text as it is."""
    rng = random.Random(0)
    for _ in range(50):
        shades = iter(range(200))
        expected, messages = [], []
        for _ in range(rng.randint(0, 3)):
            parts = []
            for _ in range(rng.randint(0, 3)):
                if rng.random() < 0.5:
                    parts.append({"type": "text", "text": rng.choice(["a", "bc", ""])})
                else:
                    shade = next(shades)
                    expected.append(shade)
                    image = Image.new("RGB", (2, 2), (shade, 0, 0))
                    parts.append({"type": "image", "image": image})
            messages.append({"role": "tool", "content": parts})
        out, images = message_images(messages, "<I>")
        assert sum(m["content"].count("<I>") for m in out) == len(images) == len(expected)
        assert [im.getpixel((0, 0))[0] for im in images] == expected


@pytest.mark.parametrize(
    ("content", "given", "reason"),
    [
        ([{"type": "image", "image": b"not an image"}], 0, "unreadable image"),
        ([{"type": "image_url", "image_url": {"url": "https://x/y.png"}}], 0, "data URL"),
        ([{"type": "image_url", "image_url": "data:image/png;base64,@@"}], 0, "not base64"),
        ([{"type": "audio"}], 0, "neither text nor image"),
        ("<I><I>", 1, "image count differs"),
        ("no placeholder", 1, "image count differs"),
    ],
)
def test_an_observation_image_that_cannot_be_read_or_placed_is_bad_row(content, given, reason):
    images = [Image.new("RGB", (2, 2))] * given
    with pytest.raises(BadRow, match=reason):
        message_images([{"role": "tool", "content": content}], "<I>", images)
