"""A vision-language policy behind `rlhf-dist serve` (docs/serving.md, "Images"): one
server process of the tiny LLaVA (tests/vision_models.py) for the module.

- the official `openai` client asks a question about a base64 data-URL image on
  /v1/chat/completions: the prompt ids are the trainer's own (data/rows.py prompt_set on
  the same row), and the answer's `logprobs.content` equal the trainer's forward
  (engine/forward.py token_logprobs with the pixel inputs) to 1e-4 in fp32;
- /generate with the same prompt and its image as a base64 PNG, or as the pixel inputs,
  samples the same tokens at the same seed; an image the prompt's tokens do not fit, an
  http(s) URL and image tokens without images are one-line 400s;
- GRPO with generation.backend=server trains on served image rollouts, the sampler's
  log-probs the trainer's to 1e-4, and on served turns of in-process episodes whose
  observation is an image.
"""

from __future__ import annotations

import base64
import io
import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from serve_process import served
from vision_models import (
    assert_trained_language_only,
    build_tiny_llava,
    colour_image,
    every_other_word,
    llava_colour_reward,
    llava_rows,
)

import rlhf_dist
from rlhf_dist.config import Config, DataConfig, ModelConfig

TOKEN = "vision-serve-token-5d2a"
ENV = "RLHF_DIST_TEST_VISION_SERVE_TOKEN"
QUESTION = "what colour is this"


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> Path:
    return build_tiny_llava(tmp_path_factory.mktemp("llava_serve") / "model")


@pytest.fixture(scope="module")
def server(llava):
    tree = {"model": {"policy": str(llava)}, "perf": {"num_threads": 1},
            "distributed": {"timeout_s": 60}}  # fmt: skip
    with served(tree, ENV, TOKEN) as url:
        yield url


def png_b64(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def call(url: str, path: str, body: dict) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"}
    request = urllib.request.Request(url + path, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def trainer_prompt(llava: Path, image) -> tuple[list[int], dict]:
    """(ids, pixel inputs) of the question about `image` as the trainer reads the row."""
    from transformers import AutoTokenizer

    from rlhf_dist.data.rows import prompt_set
    from rlhf_dist.models.vision import policy_vision

    vision = policy_vision(Config(model=ModelConfig(policy=str(llava))))
    content = [{"type": "image"}, {"type": "text", "text": QUESTION}]
    row = {"prompt": [{"role": "user", "content": content}], "image": image}
    tokenizer = AutoTokenizer.from_pretrained(str(llava))
    prompts = prompt_set([row], tokenizer, DataConfig(), vision=vision)
    return prompts.ids[0], prompts.media[0]


def trainer_logprobs(llava: Path, prompt: list[int], response: list[int], media: dict, T: float):
    from rlhf_dist.engine.forward import token_logprobs
    from rlhf_dist.models import load_causal_lm

    model = load_causal_lm(str(llava), "model.policy", "float32", ModelConfig(policy=str(llava)))
    ids = torch.tensor([prompt + response])
    predict = torch.ones(1, len(response), dtype=torch.bool)
    with torch.no_grad():
        lp, _ = token_logprobs(model.eval(), ids, torch.ones_like(ids), predict, T, media=media)
    return lp[0]


def test_openai_client_image_question_matches_the_trainers_forward(llava, server):
    openai = pytest.importorskip("openai")
    image = colour_image("red", (20, 18))
    api = openai.OpenAI(base_url=server + "/v1", api_key=TOKEN)
    url = "data:image/png;base64," + png_b64(image)
    content = [{"type": "image_url", "image_url": {"url": url}},
               {"type": "text", "text": QUESTION}]  # fmt: skip
    reply = api.chat.completions.create(
        model="llava", messages=[{"role": "user", "content": content}], max_tokens=8,
        temperature=0.7, seed=5, logprobs=True,
    )  # fmt: skip
    choice = reply.choices[0].model_dump()
    prompt, response = choice["prompt_token_ids"], choice["token_ids"]
    ids, media = trainer_prompt(llava, image)
    assert prompt == ids  # the trainer's placeholders, expanded to the image's tokens
    served_lp = torch.tensor([t["logprob"] for t in choice["logprobs"]["content"]])
    assert len(response) == len(served_lp) > 0
    ours = trainer_logprobs(llava, prompt, response, media, 0.7)
    assert (served_lp - ours).abs().max() < 1e-4
    # the image reaches the model: another colour changes the log-probs of that response
    _, blue = trainer_prompt(llava, colour_image("blue", (20, 18)))
    assert (trainer_logprobs(llava, prompt, response, blue, 0.7) - ours).abs().max() > 1e-4

    # /generate: the same prompt with its image as a PNG, or as its pixel inputs
    from rlhf_dist.generation.server import pixel_specs

    sampling = {"max_new_tokens": 8, "temperature": 0.7, "seed": 5}
    for extra in ({"images": [[png_b64(image)]]}, {"pixels": [pixel_specs(media)]}):
        status, got = call(server, "/generate", {"prompts": [prompt], "sampling": sampling} | extra)
        assert status == 200, got
        assert got["responses"][0] == response
        assert torch.allclose(torch.tensor(got["logprobs"][0]), served_lp, atol=1e-6)


def test_bad_images_are_one_line_400s(server, llava):
    ids, _ = trainer_prompt(llava, colour_image("red"))
    sampling = {"max_new_tokens": 2}
    http = [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]
    status, got = call(server, "/v1/chat/completions",
                       {"messages": [{"role": "user", "content": http}], "max_tokens": 2})  # fmt: skip
    assert status == 400 and "http(s) image URLs are not fetched" in got["detail"]
    url = "data:image/png;base64," + png_b64(colour_image("red"))
    turn = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": url}]}],
            "max_tokens": 2, "model": "llava#episode-1"}  # fmt: skip
    status, got = call(server, "/v1/chat/completions", turn)  # an episode's turn takes images
    image_id = json.loads((llava / "config.json").read_text())["image_token_index"]
    assert status == 200 and got["choices"][0]["prompt_token_ids"].count(image_id) == 4
    bad = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    status, got = call(server, "/v1/chat/completions", turn | {"messages": [
        {"role": "user", "content": bad}], "model": "llava#episode-2"})  # fmt: skip
    assert status == 400 and "unreadable image" in got["detail"]
    status, got = call(server, "/v1/chat/completions",
                       {"messages": [{"role": "user", "content": bad}], "max_tokens": 2})  # fmt: skip
    assert status == 400 and "unreadable image" in got["detail"]
    status, got = call(server, "/generate", {"prompts": [ids], "sampling": sampling})
    assert status == 400 and "image tokens without images" in got["detail"]
    two = [[png_b64(colour_image("red"))] * 2]
    status, got = call(server, "/generate", {"prompts": [ids], "sampling": sampling, "images": two})
    assert status == 400 and "the images take 8 image tokens, the prompt holds 4" in got["detail"]


def test_grpo_trains_on_served_image_rollouts(llava, server, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, TOKEN)
    out = tmp_path / "grpo"
    config = {
        "model": {"policy": str(llava)},
        "ppo": {"iterations": 1, "rollout_batch_size": 4, "samples_per_prompt": 2,
                "minibatch_size": 8, "micro_batch_size": 4, "optim": {"lr": 1e-2}},
        "generation": {"max_new_tokens": 6, "backend": "server", "server_urls": [server],
                       "server_token_env": ENV},
        "run": {"output_dir": str(out), "log_every": 1},
        "distributed": {"timeout_s": 60},
    }  # fmt: skip
    summary = rlhf_dist.grpo(
        config, dataset=llava_rows(8, kind="grpo"), reward_fn=llava_colour_reward
    )
    assert summary["iterations"] == 1
    before, after = (load_file(str(p / "model.safetensors")) for p in (llava, out / "final"))
    assert_trained_language_only(before, after)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "rollout/sampler_logprob_absdiff" in r]
    assert len(logged) == 1 and logged[0]["rollout/sampler_logprob_absdiff"] < 1e-4
    assert logged[0]["rollout/server_sync_gap"] < 1e-4


def episode_grpo_config(llava, server, out, generation: dict) -> dict:
    """One GRPO iteration of 4 prompts x 2 samples on the server's tiny LLaVA, episodes
    played by `generation`'s environment keys."""
    return {
        "model": {"policy": str(llava)},
        "ppo": {"iterations": 1, "rollout_batch_size": 4, "samples_per_prompt": 2,
                "minibatch_size": 8, "micro_batch_size": 4, "optim": {"lr": 1e-2}},
        "generation": {"max_new_tokens": 4, "backend": "server", "server_urls": [server],
                       "server_token_env": ENV, **generation},
        "run": {"output_dir": str(out), "log_every": 1, "seed": 1},
        "distributed": {"timeout_s": 60},
    }  # fmt: skip


def test_grpo_with_image_observations_on_served_turns(llava, server, tmp_path, monkeypatch):
    """In-process episodes whose observation is an image (vision_models.ImageObservation,
    docs/vision.md "Images from tools and environments"), each turn sampled by the server
    from the episode's ids so far and the pixel inputs of all its images so far."""
    monkeypatch.setenv(ENV, TOKEN)
    out = tmp_path / "grpo_episodes"
    config = episode_grpo_config(llava, server, out, {
        "environment": "vision_models:ImageObservation", "max_turns": 2,
        "max_episode_tokens": 96, "stop_token_ids": every_other_word(llava)})  # fmt: skip
    rlhf_dist.grpo(config, dataset=llava_rows(4, kind="grpo"), reward_fn=llava_colour_reward)
    [row] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert row["rollout/turns"] > 1.0 and row["rollout/tool_calls"] > 0
    assert row["rollout/sampler_logprob_absdiff"] < 1e-4


def test_grpo_with_an_endpoint_environment_whose_observation_is_an_image(
    llava, server, tmp_path, monkeypatch
):
    """generation.environment_endpoint: the environment sends the row's image and, after the
    policy's first answer, an observation image as `image_url` parts (vision_models
    .image_episode); the server records the episode token in, token out with its images'
    pixel inputs, and the trainer's forwards over the whole episode with them give the
    served turns' log-probs (< 1e-4)."""
    monkeypatch.setenv(ENV, TOKEN)
    out = tmp_path / "grpo_endpoint"
    config = episode_grpo_config(llava, server, out, {
        "environment": "vision_models:image_episode", "environment_endpoint": True})  # fmt: skip
    rlhf_dist.grpo(config, dataset=llava_rows(4, kind="grpo"), reward_fn=llava_colour_reward)
    [row] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert row["rollout/turns"] == 2.0 and row["rollout/tool_calls"] == 1.0
    assert row["rollout/sampler_logprob_absdiff"] < 1e-4
    before, after = (load_file(str(p / "model.safetensors")) for p in (llava, out / "final"))
    assert_trained_language_only(before, after)


def test_served_image_rollouts_one_step_off_policy_are_refused_naming_the_key(llava):
    from rlhf_dist.config import config_from_dict
    from rlhf_dist.errors import ConfigError
    from rlhf_dist.models.vision import policy_vision

    cfg = config_from_dict({
        "model": {"policy": str(llava)}, "ppo": {"max_staleness": 1},
        "generation": {"backend": "server", "server_urls": ["http://127.0.0.1:1"],
                       "server_token_env": ENV},
    })  # fmt: skip
    with pytest.raises(ConfigError, match=r"^ppo.max_staleness: .* on-policy \(0\)$"):
        policy_vision(cfg, samples=True)
    on_policy = config_from_dict(
        {
            "model": {"policy": str(llava)},
            "generation": {
                "backend": "server",
                "server_urls": ["http://127.0.0.1:1"],
                "server_token_env": ENV,
            },
        }
    )
    assert policy_vision(on_policy, samples=True) is not None
