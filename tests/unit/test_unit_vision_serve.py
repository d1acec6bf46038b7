"""The rollout server's image pieces without a model (serving/images.py, the pixel wire
format of generation/server.py, serving/batching.py with images): tensors travel
bit for bit, OpenAI image parts become the trainer's image parts in order, and what
cannot be read is a one-line BadRequest."""

from __future__ import annotations

import base64
import io
import itertools
import re
import threading

import pytest
import torch
from PIL import Image

from rlhf_dist.generation.server import pixel_specs, tensor_of, tensor_spec
from rlhf_dist.serving.batching import RequestBatcher
from rlhf_dist.serving.images import chat_images, data_url_image, pixels_of
from rlhf_dist.serving.policy import BadRequest, SamplingRequest


def test_a_float_travels_as_its_little_endian_bytes_by_hand():
    spec = tensor_spec(torch.tensor([1.0]))
    # 1.0f is 0x3F800000: bytes 00 00 80 3F
    assert spec == {"dtype": "float32", "shape": [1], "data": "AACAPw=="}
    assert torch.equal(tensor_of(spec), torch.tensor([1.0]))


DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int64)
SHAPES = ([], [0, 3], [5], [2, 3, 4, 5])


@pytest.mark.parametrize(("dtype", "shape"), list(itertools.product(DTYPES, SHAPES)))
def test_any_tensor_comes_back_bit_for_bit(dtype, shape):
    g = torch.Generator().manual_seed(len(shape))
    t = (torch.randn(shape, generator=g) * 100).to(dtype)
    if len(shape) == 4:
        t = t.transpose(1, 3)  # not contiguous: sent in C order of its shape
    back = tensor_of(tensor_spec(t))
    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ({"dtype": "float64", "shape": [1], "data": ""}, "dtype 'float64' not in"),
        ({"dtype": "float32", "shape": [2], "data": "AACAPw=="}, "4 bytes for shape [2]"),
        ({"dtype": "float32", "shape": [-1], "data": ""}, "shape must be a list of sizes"),
        ({"dtype": "float32", "shape": [1], "data": "not base64!"}, "data not base64"),
    ],
)
def test_a_malformed_pixel_input_is_one_line(spec, why):
    with pytest.raises(BadRequest, match="^" + re.escape(f"pixels[3]: {why}")) as e:
        pixels_of({"pixel_values": spec}, 3)
    assert "\n" not in str(e.value)


def test_pixel_specs_of_a_row_by_processor_name():
    assert pixel_specs(None) is None and pixel_specs({}) is None
    media = {"pixel_values": torch.ones(1, 3, 2, 2), "image_grid_thw": torch.tensor([[1, 2, 2]])}
    back = pixels_of(pixel_specs(media), 0)  # type: ignore[arg-type]
    assert set(back) == set(media) and all(torch.equal(back[k], media[k]) for k in media)


def png_url(colour: tuple[int, int, int]) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (3, 2), colour).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_image_url_parts_become_image_parts_in_order():
    def part(url: str) -> dict:
        return {"type": "image_url", "image_url": {"url": url}}

    messages = [
        {"role": "system", "content": "look"},
        {"role": "user", "content": [part(png_url((255, 0, 0))), {"type": "text", "text": "and"},
                                     part(png_url((0, 0, 255)))]},
    ]  # fmt: skip
    out, images = chat_images(messages)
    assert out[0] == messages[0]
    assert out[1]["content"] == [{"type": "image"}, {"type": "text", "text": "and"},
                                 {"type": "image"}]  # fmt: skip
    assert [im.getpixel((0, 0)) for im in images] == [(255, 0, 0), (0, 0, 255)]


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("https://example.com/a.png", "http\\(s\\) image URLs are not fetched"),
        ("http://10.0.0.1/a.png", "http\\(s\\) image URLs are not fetched"),
        ("file:///etc/passwd", "not a base64 data URL"),
        ("data:text/plain;base64,aGk=", "not a base64 data URL"),
        ("data:image/png;base64,@@@", "not base64"),
        ("data:image/png;base64,aGVsbG8=", "unreadable image"),
    ],
)
def test_an_image_url_that_is_not_a_readable_data_url_is_refused(url, why):
    with pytest.raises(BadRequest, match=rf"^where: {why}"):
        data_url_image(url, "where")


def test_a_part_neither_text_nor_image_url_is_refused():
    audio = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]
    with pytest.raises(BadRequest, match=r"content\[0\]: only text and image_url parts"):
        chat_images(audio)


class RecordingPolicy:
    """What RequestBatcher calls of a ServedPolicy: records each generate call."""

    def __init__(self) -> None:
        self.calls: list[tuple[list, list | None]] = []

    def checked_stops(self, prompts: list, s: SamplingRequest) -> tuple:
        return ()

    def row_media(self, prompts: list, media: list | None) -> None:
        return None

    def generate(self, prompts: list, s: SamplingRequest, seeds: list, media: list | None) -> dict:
        self.calls.append((prompts, media))
        n = len(prompts)
        return {"responses": [[p[0]] for p in prompts], "logprobs": [[0.0]] * n,
                "finished": [True] * n, "version": 0}  # fmt: skip


def test_merged_requests_keep_each_prompts_images_beside_it():
    policy = RecordingPolicy()
    batcher = RequestBatcher(policy, window_s=0.5, max_rows=8)  # type: ignore[arg-type]
    s = SamplingRequest(max_new_tokens=1, min_new_tokens=0, temperature=1.0, top_k=0,
                        top_p=1.0, seed=0)  # fmt: skip
    red = {"pixel_values": torch.zeros(1, 3, 2, 2)}
    requests = [([[1], [2]], None), ([[3]], [red])]
    answers: list = [None, None]

    def ask(i: int) -> None:
        answers[i] = batcher.generate(requests[i][0], s, requests[i][1])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    [(prompts, media)] = policy.calls  # one generate call for both
    by_first = dict(zip((p[0] for p in prompts), media or []))
    assert by_first[1] is None and by_first[2] is None and by_first[3] is red
    assert sorted(a["responses"][0][0] for a in answers) == [1, 3]
