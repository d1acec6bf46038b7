"""A vision-language policy end to end on two tiny families built here with their real
processors (tests/vision_models.py; docs/vision.md): a LLaVA (a fixed number of image
tokens) and a Qwen2-VL (dynamic resolution, M-RoPE; its image-only processor here, without
torchvision). Loading with the vision tower frozen, the image tokens of a row, the decode
loop's prefill with pixel inputs against the trainer's forward, SFT, DPO and GRPO through
the Python API and DPO and GRPO through the command line on batches mixing image sizes
and rows with 0, 1 and 2 images, and bad images as counted skips or one error line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from vision_models import (
    assert_trained_language_only,
    build_tiny_llava,
    build_tiny_qwen_vl,
    colour_image,
    llava_colour_reward,
    llava_rows,
)

import rlhf_dist
from rlhf_dist.config import Config, GenerationConfig, ModelConfig, PerfConfig
from rlhf_dist.errors import ConfigError
from rlhf_dist.models.vision import is_vision_part

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> Path:
    return build_tiny_llava(tmp_path_factory.mktemp("llava") / "model")


# family -> (its image placeholder in a prompt's text, the image size scale of llava_rows:
# Qwen2-VL's processor resizes images to at least 56 x 56, so 3x sizes give several grids)
FAMILIES = {
    "llava": ("<image> ", 1),
    "qwen2_vl": ("<|vision_start|><|image_pad|><|vision_end|>", 3),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def vlm(request, llava, tmp_path_factory) -> tuple[Path, str, int]:
    """(the model directory, its image placeholder text, llava_rows' image scale) of each
    family: the tests taking it run once per family."""
    placeholder, scale = FAMILIES[request.param]
    if request.param == "llava":
        return llava, placeholder, scale
    path = build_tiny_qwen_vl(tmp_path_factory.mktemp("qwen2_vl") / "model", "qwen2_vl")
    return path, placeholder, scale


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def test_loads_through_image_text_to_text_with_its_vision_frozen(llava):
    from rlhf_dist.models import load_causal_lm
    from rlhf_dist.models.lora import dense_targets

    model = load_causal_lm(str(llava), "model.policy", "float32", ModelConfig(policy=str(llava)))
    assert type(model).__name__ == "LlavaForConditionalGeneration"
    for name, p in model.named_parameters():
        assert p.requires_grad != is_vision_part(name), name
    targets = dense_targets(model, ("q_proj", "v_proj"))
    assert targets and all(not is_vision_part(t) and "language_model" in t for t in targets)
    free = ModelConfig(policy=str(llava), freeze_vision=False)
    model = load_causal_lm(str(llava), "model.policy", "float32", free)
    assert all(p.requires_grad for p in model.parameters())


def test_each_placeholder_becomes_the_processors_image_tokens(llava):
    from rlhf_dist.models.vision import policy_vision

    vision = policy_vision(Config(model=ModelConfig(policy=str(llava))))
    assert vision is not None and vision.placeholder == "<image>"
    P = vision.placeholder_id
    ids, trained, media = vision.expand([10, P, 11], [False, False, True], [colour_image("red")])
    assert ids == [10, P, P, P, P, 11]  # (16 / 8)^2 patch features, CLS dropped
    assert trained == [False] * 5 + [True]
    assert media is not None and list(media) == ["pixel_values"]
    assert media["pixel_values"].shape == (1, 3, 16, 16)


def prompts(vision, placeholder: str, scale: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Left-padded prompts (3, P) with 1, 2 (of different sizes) and 0 images, their mask
    and their joined pixel inputs."""
    from rlhf_dist.data.rows import left_pad
    from rlhf_dist.data.vision import join_media

    tok, rows, media = vision.processor.tokenizer, [], []
    questions = (["red"], "what colour"), (["blue", "green"], "what colour is this"), ([], "what")
    for colours, words in questions:
        text = "<|im_start|>user\n" + placeholder * len(colours) + words + "<|im_end|>\n"
        ids = tok(text + "<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
        sizes = [(scale * (18 + 5 * i), scale * 16) for i in range(len(colours))]
        images = [colour_image(c, size) for c, size in zip(colours, sizes)]
        ids, _, m = vision.expand(ids, [False] * len(ids), images)
        rows.append(ids)
        media.append(m)
    prompt_ids, prompt_mask = left_pad(rows, tok.pad_token_id)
    return prompt_ids, prompt_mask, join_media(media)


def test_decode_loop_prefill_with_pixels_agrees_with_the_trainers_forward(vlm):
    """The decode loop's KV-cache path (prefill with the pixel inputs, then one token per
    step; Qwen2-VL: its M-RoPE positions, `forward.positions_of`) and the trainer's
    whole-sequence forward give the same log-probs (< 1e-4 in fp32) on left-padded rows
    with 0, 1 and 2 images of different sizes; the images matter to both."""
    from rlhf_dist.data.vision import token_inputs
    from rlhf_dist.engine.decode import cut_before, generate, truncate_after_eos
    from rlhf_dist.engine.forward import (
        cache_of,
        causal_lm,
        positions_of,
        prompt_cache,
        token_logprobs,
    )
    from rlhf_dist.models import load_causal_lm
    from rlhf_dist.models.vision import policy_vision

    path, placeholder, scale = vlm
    torch.manual_seed(0)
    model = load_causal_lm(str(path), "model.policy", "float32", ModelConfig(policy=str(path)))
    vision = policy_vision(Config(model=ModelConfig(policy=str(path))))
    assert vision is not None
    tok = vision.processor.tokenizer
    prompt_ids, prompt_mask, pixels = prompts(vision, placeholder, scale)
    gen = GenerationConfig(max_new_tokens=8, temperature=1.0)
    response = generate(model, prompt_ids, prompt_mask, gen, tok, media=pixels)
    response, response_mask, done = truncate_after_eos(response, tok.eos_token_id, tok.pad_token_id)
    # as the rollout does: a sampled image token would ask for an image the prompt lacks
    response, response_mask, _ = cut_before(
        response, response_mask, done, vision.image_token_id, tok.pad_token_id
    )

    with torch.no_grad():  # the decode loop's own path, fed the sampled tokens
        out, cache, _ = prompt_cache(model, prompt_ids, prompt_mask, False, pixels)
        logits, mask = out.logits[:, -1], prompt_mask
        position = positions_of(model.config, prompt_ids, prompt_mask, pixels)[..., -1:]
        steps = []
        for t in range(response.shape[1]):
            steps.append(torch.log_softmax(logits.float(), -1).gather(1, response[:, t : t + 1]))
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            position = position + 1
            out = model(
                input_ids=response[:, t : t + 1],
                attention_mask=mask,
                position_ids=position,
                use_cache=True,
                **cache,
            )
            logits, cache = out.logits[:, -1], cache_of(out)
        decoded = torch.cat(steps, dim=1) * response_mask
        ids = torch.cat([prompt_ids, response], 1)
        attention = torch.cat([prompt_mask, response_mask.long()], 1)
        P = prompt_ids.shape[1]
        trainer, _ = token_logprobs(
            model, ids, attention, response_mask, 1.0, False, P, media=pixels
        )
        other = {**pixels, "pixel_values": pixels["pixel_values"].flip(0)}  # images changed
        swapped, _ = token_logprobs(
            model, ids, attention, response_mask, 1.0, False, P, media=other
        )
        if "image_grid_thw" in pixels:  # Qwen2-VL: our M-RoPE ids are transformers' own
            causal_lm(model).model.rope_deltas = None  # its own rule, computed afresh
            inputs = {"input_ids": ids, "attention_mask": attention, "use_cache": False}
            logits = model(**inputs, **token_inputs(ids, pixels)).logits[:, P - 1 : -1]
            own = torch.log_softmax(logits.float(), -1).gather(-1, response[..., None])
            assert float((own.squeeze(-1) * response_mask - trainer).abs().max()) < 1e-4
    assert float((decoded - trainer).abs().max()) < 1e-4
    assert float((swapped - trainer).abs().max()) > 1e-3


def test_the_decode_loop_never_feeds_a_sampled_image_token(vlm, monkeypatch):
    """A row that samples the image token (forced here at its second step) ends there and
    no decode step feeds that token: its prompt has no image for it."""
    from rlhf_dist.engine import decode
    from rlhf_dist.engine.forward import causal_lm
    from rlhf_dist.models import load_causal_lm
    from rlhf_dist.models.vision import policy_vision

    path, placeholder, scale = vlm
    torch.manual_seed(0)
    model = load_causal_lm(str(path), "model.policy", "float32", ModelConfig(policy=str(path)))
    vision = policy_vision(Config(model=ModelConfig(policy=str(path))))
    assert vision is not None
    tok, image, steps, fed = vision.processor.tokenizer, vision.image_token_id, [], []
    sample = decode.sample_next

    def forced(*args, **kwargs):  # row 0's second token is the image token
        token = sample(*args, **kwargs)
        steps.append(1)
        return token.index_fill(0, torch.tensor([0]), image) if len(steps) == 2 else token

    monkeypatch.setattr(decode, "sample_next", forced)
    record = lambda module, args, kwargs: fed.append(kwargs["input_ids"].clone())  # noqa: E731
    hook = causal_lm(model).register_forward_pre_hook(record, with_kwargs=True)
    prompt_ids, prompt_mask, pixels = prompts(vision, placeholder, scale)
    gen = GenerationConfig(max_new_tokens=5, min_new_tokens=5, temperature=1.0)
    try:
        out = decode.generate(model, prompt_ids, prompt_mask, gen, tok, media=pixels)
    finally:
        hook.remove()
    assert out.shape == (3, 5) and int(out[0, 1]) == image
    assert (out[0, 2:] == tok.pad_token_id).all()
    assert len(fed) == 5 and all(not (ids == image).any() for ids in fed[1:])


def test_a_weight_swap_mid_response_reruns_the_prompt_with_its_images(vlm, monkeypatch):
    """A served partial rollout whose weights change after the second token (a `StepWatch`
    swap) recomputes the KV cache of the prompt and the tokens so far with the prompts'
    images and positions (a sampled image token PAD there, as never fed): each token's
    sampled log-prob is its own weights' whole-sequence forward with the images."""
    import copy

    from rlhf_dist.engine import decode
    from rlhf_dist.engine.forward import token_logprobs
    from rlhf_dist.models import load_causal_lm
    from rlhf_dist.models.vision import policy_vision

    path, placeholder, scale = vlm
    torch.manual_seed(0)
    model = load_causal_lm(str(path), "model.policy", "float32", ModelConfig(policy=str(path)))
    vision = policy_vision(Config(model=ModelConfig(policy=str(path))))
    assert vision is not None
    old, tok, image = copy.deepcopy(model), vision.processor.tokenizer, vision.image_token_id
    sample, steps = decode.sample_next, []

    def forced(*args, **kwargs):  # row 0's second token is the image token
        steps.append(token := sample(*args, **kwargs))
        return token.index_fill(0, torch.tensor([0]), image) if len(steps) == 2 else token

    class Swap:  # the new weights land after the second token
        def __init__(self):
            self.logps: list[torch.Tensor] = []  # (B, 1) per step: the sampled token's

        def sampled(self, logits, token):
            self.logps.append(torch.log_softmax(logits.float(), -1).gather(1, token[:, None]))

        def swapped(self, tokens):
            if tokens == 2:
                g = torch.Generator().manual_seed(1)
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.05 * torch.randn(p.shape, generator=g))
            return tokens == 2

    monkeypatch.setattr(decode, "sample_next", forced)
    prompt_ids, prompt_mask, pixels = prompts(vision, placeholder, scale)
    gen = GenerationConfig(max_new_tokens=5, min_new_tokens=5, temperature=1.0)
    watch, unpacked = Swap(), PerfConfig(packed_linears=False)  # as serving/partial.py decodes
    out = decode.generate(
        model, prompt_ids, prompt_mask, gen, tok, perf=unpacked, media=pixels, watch=watch
    )
    assert int(out[0, 1]) == image and len(watch.logps) == 5
    sampled = torch.cat(watch.logps, 1)  # (3, 5)
    # as the rollout does: a row ends at its image token (row 0 at token 1), cut before it
    response, mask, done = decode.truncate_after_eos(out, tok.eos_token_id, tok.pad_token_id)
    response, mask, _ = decode.cut_before(response, mask, done, image, tok.pad_token_id)
    assert not mask[0, 1:].any() and mask[:, 2:].any()  # tokens after the swap count
    ids, P = torch.cat([prompt_ids, response], 1), prompt_ids.shape[1]
    attention = torch.cat([prompt_mask, mask.long()], 1)
    with torch.no_grad():
        before, _ = token_logprobs(old, ids, attention, mask, 1.0, False, P, media=pixels)
        after, _ = token_logprobs(model, ids, attention, mask, 1.0, False, P, media=pixels)
    sampled = sampled * mask
    torch.testing.assert_close(sampled[:, :2], before[:, :2], atol=1e-4, rtol=0)
    torch.testing.assert_close(sampled[:, 2:], after[:, 2:], atol=1e-4, rtol=0)
    assert float((sampled[:, 2:] - before[:, 2:]).abs().max()) > 1e-3  # the swap mattered


def test_sft_through_the_python_api_trains_the_language_model_only(vlm, tmp_path):
    llava, _, scale = vlm
    out = tmp_path / "sft"
    config = {
        "model": {"policy": str(llava)},
        "sft": {"batch_size": 6, "micro_batch_size": 3, "epochs": 1, "optim": {"lr": 1e-2}},
        "run": {"output_dir": str(out)},
    }
    rows = llava_rows(12, scale=scale)  # 0, 1 and 2 images of several sizes
    summary = rlhf_dist.sft(config, dataset=rows)
    assert summary["train_examples"] == 12 and summary["steps"] == 2
    assert_trained_language_only(weights(llava), weights(out / "final"))
    from rlhf_dist.models.qwen_vl import load_processor

    saved = type(load_processor(out / "final")).__name__
    assert saved == type(load_processor(llava)).__name__
    assert saved.startswith(("LlavaProcessor", "Qwen2VLProcessor"))


def test_dpo_through_the_python_api_trains_the_language_model_only(vlm, tmp_path):
    llava, _, scale = vlm
    out = tmp_path / "dpo"
    config = {
        "model": {"policy": str(llava)},
        "dpo": {"batch_size": 4, "micro_batch_size": 2, "optim": {"lr": 1e-2}},
        "run": {"output_dir": str(out)},
    }
    summary = rlhf_dist.dpo(config, dataset=llava_rows(8, kind="dpo", scale=scale))
    assert summary["steps"] == 2
    assert_trained_language_only(weights(llava), weights(out / "final"))


def test_grpo_through_the_python_api_samples_with_images_and_trains(vlm, tmp_path):
    llava, _, scale = vlm
    out = tmp_path / "grpo"
    config = {
        "model": {"policy": str(llava)},
        "ppo": {
            "iterations": 1,
            "rollout_batch_size": 4,
            "samples_per_prompt": 2,
            "minibatch_size": 8,
            "micro_batch_size": 4,
            "optim": {"lr": 1e-2},
        },
        "generation": {"max_new_tokens": 6},
        "run": {"output_dir": str(out)},
    }
    summary = rlhf_dist.grpo(
        config, dataset=llava_rows(8, kind="grpo", scale=scale), reward_fn=llava_colour_reward
    )
    assert summary["iterations"] == 1
    assert_trained_language_only(weights(llava), weights(out / "final"))


def cli(*args: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join([str(REPO), str(REPO / "tests")])  # vision_models' reward
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "rlhf_dist", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def image_rows(root: Path) -> list[dict]:
    """DPO rows with image paths, as a .jsonl holds them: 0, 1 and 2 images per prompt,
    then a missing file, a corrupt file and two image parts for one image."""
    root.mkdir(parents=True, exist_ok=True)
    paths = {}
    for i, colour in enumerate(("red", "green", "blue")):
        paths[colour] = str(root / f"{colour}.png")
        colour_image(colour, (16 + 6 * i, 20)).save(paths[colour])
    (root / "corrupt.png").write_bytes(b"\x89PNG not really")
    text = {"type": "text", "text": "what colour is this"}

    def row(images: list[str], parts: int, chosen: str, rejected: str) -> dict:
        prompt = [{"role": "user", "content": [{"type": "image"}] * parts + [text]}]
        chosen_turn = [{"role": "assistant", "content": chosen}]
        rejected_turn = [{"role": "assistant", "content": rejected}]
        return {
            "prompt": prompt,
            "chosen": chosen_turn,
            "rejected": rejected_turn,
            "images": images,
        }

    good = [
        row([], 0, "none", "red"),
        row([paths["red"]], 1, "red", "blue"),
        row([paths["green"], paths["blue"]], 2, "green and blue", "red and red"),
        row([paths["blue"]], 1, "blue", "green"),
    ]
    bad = [
        row([str(root / "missing.png")], 1, "red", "blue"),
        row([str(root / "corrupt.png")], 1, "red", "blue"),
        row([paths["red"]], 2, "red", "blue"),
    ]
    return good * 2 + bad


def test_dpo_through_the_cli_with_image_paths_counts_bad_images(llava, tmp_path):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in image_rows(tmp_path / "img")))
    out = tmp_path / "dpo"
    before = {p.name: p.read_bytes() for p in llava.iterdir()}
    proc = cli(
        "dpo", f"model.policy={llava}", f"data.train={data}", f"run.output_dir={out}",
        "dpo.batch_size=4", "dpo.micro_batch_size=2", "dpo.optim.lr=1e-2",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("preference pairs:"))
    assert "8 kept" in line and "3 skipped" in line, line
    for reason in (
        "image file not found",
        "unreadable image",
        "image count differs from the image placeholders",
    ):
        assert reason in line, line
    assert_trained_language_only(weights(llava), weights(out / "final"))
    # the reference is the policy's directory, read and never written
    assert before == {p.name: p.read_bytes() for p in llava.iterdir()}


def test_nothing_to_train_is_one_error_line_and_no_run_directory(llava, tmp_path):
    rows = image_rows(tmp_path / "img")[-3:]  # the three bad ones, through the Python API
    out = tmp_path / "never"
    config = {"model": {"policy": str(llava)}, "run": {"output_dir": str(out)}}
    with pytest.raises(ConfigError) as error:
        rlhf_dist.dpo(config, dataset=rows)
    line = str(error.value)
    assert "\n" not in line and "0 kept, 3 skipped" in line and "image file not found" in line
    assert not out.exists()


def test_grpo_through_the_cli_reads_image_paths(vlm, tmp_path):
    llava, _, scale = vlm
    paths = []
    for i, colour in enumerate(("red", "green", "blue", "red")):
        paths.append(str(tmp_path / f"{i}.png"))
        colour_image(colour, (scale * (16 + 3 * i), scale * 18)).save(paths[-1])
    prompt = [{"role": "user", "content": "what colour is this"}]  # TRL places the image
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": prompt, "image": p}) + "\n" for p in paths))
    out = tmp_path / "grpo"
    proc = cli(
        "grpo", f"model.policy={llava}", f"data.train={data}", f"run.output_dir={out}",
        "reward.function=vision_models:llava_colour_reward", "ppo.iterations=1",
        "ppo.rollout_batch_size=4", "ppo.samples_per_prompt=2", "ppo.minibatch_size=8",
        "ppo.micro_batch_size=4", "ppo.optim.lr=1e-2", "generation.max_new_tokens=6",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "prompts: 4 kept" in proc.stdout
    assert_trained_language_only(weights(llava), weights(out / "final"))


def test_packing_with_images_is_refused_naming_the_key(llava, tmp_path):
    config = {
        "model": {"policy": str(llava)},
        "perf": {"packed_sequences": True},
        "run": {"output_dir": str(tmp_path / "out")},
    }
    with pytest.raises(ConfigError, match=r"^perf\.packed_sequences: "):
        rlhf_dist.sft(config, dataset=llava_rows(6))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("section", "values", "key"),
    [
        ("distributed", {"sequence_parallel_size": 2}, "distributed.sequence_parallel_size"),
        ("debug", {"check_vllm_sync": True}, "debug.check_vllm_sync"),
    ],
)
def test_what_images_do_not_work_with_is_refused_naming_its_key(llava, section, values, key):
    import dataclasses

    from rlhf_dist.models.vision import policy_vision

    cfg = Config(model=ModelConfig(policy=str(llava)))
    cfg = dataclasses.replace(
        cfg, **{section: dataclasses.replace(getattr(cfg, section), **values)}
    )
    if section == "debug":  # vLLM's sync check, with vLLM
        cfg = dataclasses.replace(cfg, generation=GenerationConfig(backend="vllm"))
    with pytest.raises(ConfigError, match=rf"^{key}: "):
        policy_vision(cfg, samples=True)


def test_vllm_samples_the_images_of_llava_style_policies_only(vlm):
    from rlhf_dist.models.vision import policy_vision

    path = vlm[0]
    cfg = Config(model=ModelConfig(policy=str(path)), generation=GenerationConfig(backend="vllm"))
    if path.parent.name.startswith("llava"):
        assert policy_vision(cfg, samples=True) is not None
    else:  # vLLM cannot import its Qwen2-VL without torchvision
        with pytest.raises(ConfigError, match=r"^generation\.backend: .*'qwen2_vl'"):
            policy_vision(cfg, samples=True)
