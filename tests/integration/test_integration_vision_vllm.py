"""generation.backend=vllm with a vision-language policy (docs/vision.md "vLLM"): GRPO on
the tiny LLaVA of tests/vision_models.py, sampled by a real in-process vLLM engine (CPU)
from prompts holding 0, 1 or 2 images of mixed sizes, which vLLM gets as
`multi_modal_data` beside the prompt ids. One run, one engine:

- vLLM's log-prob of each sampled token is the trainer's (fp32; the text path's bound);
- the language model trains and the frozen vision tower and projector do not;
- the engine was given the actor's weights, the vision tower's included: it is loaded
  with dummy weights (vllm_images.py), so the gap above is small only if the sync
  reached every weight vLLM reads.

Skipped where vllm is not installed, like tests/integration/test_integration_vllm.py.
"""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file
from vision_models import assert_trained_language_only, build_tiny_llava, colour_image

import rlhf_dist

pytest.importorskip("vllm")

pytestmark = pytest.mark.slow


def rows(n: int) -> list[dict]:
    """GRPO rows with 0, 1 and 2 images of mixed sizes (list-of-parts prompts)."""
    out = []
    for i in range(n):
        count = i % 3
        names = [("red", "green", "blue")[(i + j) % 3] for j in range(count)]
        images = [colour_image(c, (16 + 4 * (i % 4), 16 + 3 * (i % 3))) for c in names]
        parts = [{"type": "image"}] * len(images) + [
            {"type": "text", "text": "what colour is this"}
        ]
        out.append({"prompt": [{"role": "user", "content": parts}], "images": images})
    return out


def length_reward(completions: list, **kwargs: object) -> list[float]:
    """The completion's length in characters: varies between a group's samples."""
    return [float(len(c[0]["content"] if isinstance(c, list) else c)) for c in completions]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[dict, dict, list[dict]]:
    """(weights before, weights after, metrics rows) of a 2-iteration GRPO run on vLLM."""
    root = tmp_path_factory.mktemp("vision_vllm")
    llava = build_tiny_llava(root / "model")
    config = {
        "model": {"policy": str(llava)},
        "generation": {"backend": "vllm", "max_new_tokens": 6, "vllm_kv_cache_gib": 0.25},
        "ppo": {
            "iterations": 2,
            "rollout_batch_size": 6,
            "samples_per_prompt": 2,
            "minibatch_size": 12,
            "micro_batch_size": 6,
            "optim": {"lr": 1e-2},
        },
        "run": {"output_dir": str(root / "out"), "log_every": 1},
    }
    rlhf_dist.grpo(config, dataset=rows(6), reward_fn=length_reward)
    lines = (root / "out" / "metrics.jsonl").read_text().splitlines()
    after = load_file(str(root / "out" / "final" / "model.safetensors"))
    return load_file(str(llava / "model.safetensors")), after, [json.loads(x) for x in lines]


def test_vllm_logprobs_of_image_prompts_equal_the_trainers(run):
    _, _, metrics = run
    assert [r["step"] for r in metrics] == [1, 2]
    for r in metrics:
        assert r["rollout/sampler_logprob_absdiff"] < 1e-4  # fp32: the same distribution
        assert abs(r["rollout/sampler_kl"]) < 1e-6


def test_vllm_rollouts_train_the_language_model_only(run):
    before, after, _ = run
    assert_trained_language_only(before, after)
