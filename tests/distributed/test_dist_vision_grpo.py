"""A vision-language GRPO run under 2-rank ZeRO-3 (gloo, issue 48): the tiny LLaVA of
tests/vision_models.py, prompts with one image each in mixed sizes (paths in a .jsonl,
TRL's placement rule), `rlhf-dist grpo` for 2 iterations on 1 rank and under
`accelerate launch` with ZeRO-3 on 2, at once. Decoding is greedy (generation.top_k=1),
so each response is a function of its prompt, its image and the weights alone; the
2-rank run then logs the 1-rank run's metrics (to 1e-5): its rollout, rewards, loss
and the update (moved by the entropy bonus), with the weights partitioned over the ranks (the vision tower gathered
for generation). One launch of each, shared by the asserts."""

from __future__ import annotations

import json

import pytest
from conftest import REPO, one_rank_and_zero3
from vision_models import build_tiny_llava, colour_image

# metrics that are measurements of the machine, not of the run
UNTIMED = ("time/", "memory/", "perf/", "throughput/")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    """metrics.jsonl rows of the 1-rank run and the 2-rank ZeRO-3 run, launched at once."""
    work = tmp_path_factory.mktemp("dist_vision")
    llava = build_tiny_llava(work / "llava")
    lines = []
    for i, colour in enumerate(("red", "green", "blue", "red")):
        path = work / f"{i}.png"
        colour_image(colour, (16 + 4 * i, 16 + 3 * (i % 2))).save(path)
        prompt = [{"role": "user", "content": "what colour is this"}]
        lines.append(json.dumps({"prompt": prompt, "image": str(path)}) + "\n")
    (work / "prompts.jsonl").write_text("".join(lines))

    def grpo(out) -> list[str]:
        return [
            "-m", "rlhf_dist", "grpo",
            f"model.policy={llava}",
            f"data.train={work / 'prompts.jsonl'}",
            "reward.function=vision_models:llava_colour_reward",
            f"run.output_dir={out}",
            "run.log_every=1",
            "ppo.iterations=2",
            "ppo.rollout_batch_size=4",
            "ppo.samples_per_prompt=2",
            "ppo.rollout_micro_batch_size=4",
            "ppo.minibatch_size=8",
            "ppo.micro_batch_size=2",
            "ppo.optim.lr=1e-2",
            # greedy groups are identical (GRPO advantages 0): the entropy bonus is what
            # moves the weights, through the forward with the pixel inputs
            "ppo.entropy_coef=0.1",
            "generation.max_new_tokens=6",
            "generation.top_k=1",
        ]  # fmt: skip

    env = {"PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}
    return one_rank_and_zero3(grpo, work, env)


def test_two_ranks_give_the_one_rank_runs_metrics(runs):
    one, two = runs["one"], runs["two"]
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2]
    for a, b in zip(one, two):
        keys = [k for k in a if not k.startswith(UNTIMED) and isinstance(a[k], (int, float))]
        assert {"objective/raw_score", "objective/entropy", "policy/loss"} <= set(keys)
        for k in keys:
            assert b[k] == pytest.approx(a[k], abs=1e-5, rel=1e-5), k


def test_the_update_moved_the_weights(runs):
    first, second = runs["one"]
    assert first["optim/grad_norm_actor"] > 0
    # iteration 2 sampled with the updated weights: its entropy is not iteration 1's
    assert second["objective/entropy"] != pytest.approx(first["objective/entropy"], abs=1e-4)
