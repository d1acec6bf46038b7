"""Multi-turn episodes whose observations are images (rlhf_dist/rollout/agent.py,
docs/vision.md "Images from tools and environments") on a tiny LLaVA and a tiny Qwen2-VL
built here with their real processors (tests/vision_models.py).

A GRPO iteration per family through the Python API, with an environment whose answer to
the policy's first turn is a tool message holding an image (`ImageObservation`), one row's
image unreadable: the image's tokens sit in the episode after the first turn, the
sampler's log-probs of each turn (taken with the images of its context only) equal the
trainer's over the whole episode with all of its images (< 1e-4 in fp32), the
observation is attended to but out of the loss, the unreadable one is a counted skip,
and the language model trains while the vision tower and the reference do not change.
"""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file
from vision_models import (
    assert_trained_language_only,
    build_tiny_llava,
    build_tiny_qwen_vl,
    colour_image,
    every_other_word,
    llava_colour_reward,
    llava_rows,
)

import rlhf_dist
from rlhf_dist.errors import UserError
from rlhf_dist.trainers.ppo import rollout as ppo_rollout
from rlhf_dist.trainers.ppo import setup as ppo_setup

# family -> llava_rows' image scale (Qwen2-VL's processor resizes to at least 56 x 56)
FAMILIES = {"llava": 1, "qwen2_vl": 3}


class ScoredTurns:
    """The run's own decode loop (generation.HFSampler) as an engine is used: each turn
    through `sample`, with the log-probs of its sampled tokens under the turn's context
    and that context's images only, as the rollout servers return them."""

    from_actor = False
    in_step = False

    def __init__(self, inner: object) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def sample(self, *args: object, **kwargs: object) -> object:
        return self.inner.sample(*args, **{**kwargs, "logprobs": True})


class Lines(logging.Handler):
    """The messages of the log records it handles."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def episodes(request, tmp_path_factory):
    """(model dir, output dir, the recorded (batch, texts, RolloutModels), the processor's
    image token id, the rollout's warnings) of one GRPO iteration with `ImageObservation`, the last prompt's image
    unreadable."""
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "llava":
        path = build_tiny_llava(root / "model")
    else:
        path = build_tiny_qwen_vl(root / "model", "qwen2_vl")
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    rows = llava_rows(4, kind="grpo", scale=FAMILIES[request.param])
    rows = [{**r, "corrupt": i == 3} for i, r in enumerate(rows)]
    out = root / "grpo"
    config = {
        "model": {"policy": str(path)},
        "generation": {
            "max_new_tokens": 4,
            "environment": "vision_models:ImageObservation",
            "max_turns": 2,
            "max_episode_tokens": 96,
            "stop_token_ids": every_other_word(path),
        },
        "ppo": {
            "iterations": 1,
            "rollout_batch_size": 4,
            "samples_per_prompt": 2,
            "minibatch_size": 8,
            "micro_batch_size": 4,
            "kl_coef": 0.05,
            "optim": {"lr": 1e-2},
        },
        "run": {"output_dir": str(out), "seed": 1, "log_every": 1},
    }
    recorded, collect, make = [], ppo_rollout.collect_rollout, ppo_setup.make_sampler

    def spy(*args, **kwargs):
        batch, texts = collect(*args, **kwargs)
        recorded.append((batch, texts, args[0]))
        return batch, texts

    warned, logger = Lines(), logging.getLogger("rlhf_dist.rollout.collect")
    logger.addHandler(warned)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ppo_rollout, "collect_rollout", spy)
        mp.setattr(ppo_setup, "make_sampler", lambda *a: ScoredTurns(make(*a)))
        try:
            rlhf_dist.grpo(config, dataset=rows, reward_fn=llava_colour_reward)
        finally:
            logger.removeHandler(warned)
    assert before == {p.name: p.read_bytes() for p in path.iterdir()}  # the reference's files
    from transformers import AutoConfig

    image_id = AutoConfig.from_pretrained(str(path)).image_token_id
    return path, out, recorded, image_id, warned.lines


def image_tokens(media: dict[str, torch.Tensor]) -> int:
    """How many image tokens the pixel inputs of a row's images fill: LLaVA 4 per image
    (16 x 16 in 8 x 8 patches), Qwen2-VL one per 2 x 2 merged patches of each grid."""
    if "image_grid_thw" in media:
        return int(media["image_grid_thw"].prod(-1).sum()) // 4
    return 4 * media["pixel_values"].shape[0]


def test_observed_images_sit_in_the_episode_and_out_of_the_loss(episodes):
    _, _, [(batch, _, _)], image_id, _ = episodes
    observed = 0
    for b, row in enumerate(batch.media.rows):
        prompt, response = batch.prompt_ids[b], batch.response_ids[b]
        attended = batch.response_attention[b].bool()
        in_prompt = int((prompt[batch.prompt_mask[b].bool()] == image_id).sum())
        in_response = int((response[attended] == image_id).sum())
        assert in_prompt + in_response == image_tokens(row)  # every image's tokens, in the row
        assert in_prompt == image_tokens({k: v[:1] for k, v in row.items() if v.dim()})
        if in_response:  # the observation: attended to, never trained on
            observed += 1
            assert not (batch.response_mask[b] & (response == image_id)).any()
            first = int((response == image_id).nonzero()[0])
            assert not batch.response_mask[b, first - 1 : first + in_response + 1].any()
            assert batch.turns[b] == 2
    assert observed >= 2, "no episode reached the image observation"


def test_sampler_and_trainer_log_probs_agree_and_the_images_matter(episodes):
    from rlhf_dist.engine.forward import token_logprobs

    _, _, [(batch, _, models)], _, _ = episodes
    mask = batch.response_mask
    assert batch.sampler_logprobs is not None and mask.any()
    for trainer in (batch.ref_logprobs, batch.old_logprobs):
        if trainer is not None:
            assert float(((batch.sampler_logprobs - trainer) * mask).abs().max()) < 1e-4
    media = batch.pixel_inputs()
    other = {**media, "pixel_values": media["pixel_values"].flip(0)}  # images reordered
    with torch.no_grad():
        swapped, _ = token_logprobs(
            models.reference, batch.input_ids, batch.attention_mask, mask, 1.0,
            prompt_width=batch.prompt_ids.shape[1], media=other,
        )  # fmt: skip
    assert float(((swapped - batch.ref_logprobs) * mask).abs().max()) > 1e-3


def test_an_unreadable_observation_is_a_counted_skip(episodes, read_jsonl):
    _, out, [(batch, _, _)], _, warned = episodes
    skipped = batch.skipped_episodes
    assert skipped[-2:].all() and not skipped[:-2].any()  # the last prompt's two samples
    assert torch.isnan(batch.raw_scores[skipped]).all()
    [row] = read_jsonl(out / "metrics.jsonl")
    assert row["rollout/skipped_episodes"] == pytest.approx(2 / 8)
    assert warned == ["rollout: 2 episodes skipped (2 an observation's image: unreadable image)"]


def test_grpo_trains_the_language_model_only(episodes):
    path, out, _, _, _ = episodes
    before = load_file(str(path / "model.safetensors"))
    after = load_file(str(out / "final" / "model.safetensors"))
    assert_trained_language_only(before, after)


def test_the_actors_own_decode_loop_plays_the_same_episodes(episodes):
    """The decode loop over the actor (generation.backend=hf: each turn's prefill takes the
    images of its context) samples the very turns the checked sampler above does from the
    same seed, on prompts whose images the environment's first messages carry as parts."""
    import functools

    from rlhf_dist.config import GenerationConfig
    from rlhf_dist.rollout.agent import run_episodes
    from rlhf_dist.rollout.collect import _turn

    _, _, [(_, _, models)], image_id, _ = episodes
    agent, tok = models.agent, models.agent.renderer.tokenizer
    text = {"type": "text", "text": "what colour is this"}
    prompts = [
        [{"role": "user", "content": [{"type": "image", "image": colour_image(c, (56, 60))}, text]}]
        for c in ("red", "blue", "green", "red")
    ]
    gen, stops = GenerationConfig(max_new_tokens=4, temperature=1.0), models.stop_ids
    with models.generation_context() as (actor, keep_in_step):
        torch.manual_seed(3)
        own = run_episodes(agent, actor, keep_in_step, prompts, gen, tok, stops)
    torch.manual_seed(3)
    turn = functools.partial(_turn, models.sampler, tok.pad_token_id)
    engine = run_episodes(agent, None, None, prompts, gen, tok, stops, sampler=turn)
    assert [e.tokens for e in own] == [e.tokens for e in engine]
    assert any(e.turns == 2 for e in own)
    for e in own:  # one image in the prompt, one per observation
        assert len(e.media) == e.turns
        count = (e.prompt + e.tokens).count(image_id)
        assert count == image_tokens(e.pixel_inputs())


def test_a_tool_returning_an_image_answers_with_an_image_part():
    from rlhf_dist.rollout.agent import ToolEnvironment

    image = colour_image("red")
    env = ToolEnvironment({"look": lambda: image}, 5.0)
    call = '<tool_call>{"name": "look", "arguments": {}}</tool_call>'
    [message], done, _ = env.step([{"role": "assistant", "content": call}])
    assert not done and message["content"] == [{"type": "image", "image": image}]
    assert env.tool_errors == 0


def test_an_image_to_a_text_policy_is_one_error_line():
    from rlhf_dist.rollout.agent import observed

    class TextAgent:
        vision = None

    parts = [{"type": "image", "image": colour_image("red")}]
    with pytest.raises(
        UserError, match=r"^generation\.tools/environment: a tool or environment returned an image"
    ):
        observed(TextAgent(), [{"role": "tool", "content": parts}])
