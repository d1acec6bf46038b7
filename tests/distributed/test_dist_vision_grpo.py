"""Vision-language stages under 2-rank ZeRO-3 (gloo, issue 48, docs/vision.md) on the two
tiny families of tests/vision_models.py, each stage run on 1 rank and under `accelerate
launch` with ZeRO-3 on 2, both launches at once, each running every stage in one process
(scripts/run_stages.py). Decoding is greedy (generation.top_k=1), so each response is a
function of its prompt, its images and the weights alone; the 2-rank run then logs the
1-rank run's metrics (to 1e-5), with the weights partitioned over the ranks:

- LLaVA GRPO, one image per prompt in mixed sizes, the weights gathered for generation
  and for training (the defaults);
- Qwen2-VL (M-RoPE) SFT (the tower trained too), DPO and GRPO on rows with 0, 1 and 2
  images of several sizes, so that a rank's micro-batch may hold no image while the
  other's does, under ZeRO-3's per-module fetching (perf.gather_for_generation=false,
  gather_for_training=never; the GRPO reference partitioned too): the tower runs on
  every rank (zero3.tower_in_step);
- Qwen2-VL GRPO with LoRA and gradient checkpointing: the adapters train, the base and the
  vision tower do not;
- Qwen2-VL GRPO episodes whose tool returns an image (vision_models.ImageObservation).

One launch of each, shared by the asserts."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from conftest import ALL_ENGINES, ENGINES, REPO, free_port, launch_args, metrics_rows, run_all
from safetensors.torch import load_file
from vision_models import (
    assert_trained_language_only,
    build_tiny_llava,
    build_tiny_qwen_vl,
    colour_image,
    every_other_word,
)

from rlhf_dist.models.vision import is_vision_part

STAGES = REPO / "tests" / "distributed" / "scripts" / "run_stages.py"
# metrics that are measurements of the machine, or of how rows fell into micro-batches
# and ranks (padding), not of the run
UNTIMED = ("time/", "memory/", "perf/", "throughput/")
LAYOUT = ("pad_fraction",)
# ZeRO-3 fetching each module's weights in every forward and backward: the path where a
# rank without images must still run the tower
PER_MODULE = ["perf.gather_for_generation=false", "perf.gather_for_training=never"]
# images of each Qwen2-VL row (0, 1 or 2; Qwen's processor makes grids of several sizes)
QWEN_IMAGES = [["red"], ["green", "blue"], [], ["blue"], ["red", "green"], [], ["green"], ["blue"]]


def llava_prompts(work: Path) -> Path:
    """4 prompts, one image each in mixed sizes (paths; TRL's placement rule)."""
    lines = []
    for i, colour in enumerate(("red", "green", "blue", "red")):
        path = work / f"llava{i}.png"
        colour_image(colour, (16 + 4 * i, 16 + 3 * (i % 2))).save(path)
        prompt = [{"role": "user", "content": "what colour is this"}]
        lines.append(json.dumps({"prompt": prompt, "image": str(path)}) + "\n")
    (work / "llava.jsonl").write_text("".join(lines))
    return work / "llava.jsonl"


def qwen_files(work: Path) -> dict[str, Path]:
    """The Qwen2-VL stages' rows (.jsonl, image paths): SFT messages, DPO pairs and GRPO
    prompts, row i with the images QWEN_IMAGES[i] in sizes from 48 to 102 pixels."""
    sft, dpo, grpo = [], [], []
    for i, colours in enumerate(QWEN_IMAGES):
        paths = []
        for j, colour in enumerate(colours):
            paths.append(str(work / f"qwen{i}_{j}.png"))
            size = (3 * (16 + 6 * ((i + j) % 4)), 3 * (16 + 3 * (i % 3)))
            colour_image(colour, size).save(paths[-1])
        user = [{"role": "user", "content": "what colour is this"}]
        answer = " and ".join(colours) or "none"
        said = [{"role": "assistant", "content": answer}]
        wrong = [{"role": "assistant", "content": "red" if answer != "red" else "blue"}]
        sft.append({"messages": user + said, "images": paths})
        dpo.append({"prompt": user, "chosen": said, "rejected": wrong, "images": paths})
        grpo.append({"prompt": user, "images": paths})
    files = {"sft": sft, "dpo": dpo, "grpo": grpo}
    for name, rows in files.items():
        (work / f"qwen_{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {name: work / f"qwen_{name}.jsonl" for name in files}


def grpo(model: Path, data: Path, out: Path, reward: str, *extra: str) -> list[str]:
    return [
        "grpo",
        f"model.policy={model}",
        f"data.train={data}",
        f"reward.function=vision_models:{reward}",
        f"run.output_dir={out}",
        "run.log_every=1",
        "ppo.iterations=2",
        "ppo.samples_per_prompt=2",
        "ppo.minibatch_size=8",
        "ppo.micro_batch_size=2",
        "ppo.optim.lr=1e-2",
        # greedy groups are identical (GRPO advantages 0): the entropy bonus is what
        # moves the weights, through the forward with the pixel inputs
        "ppo.entropy_coef=0.1",
        "generation.max_new_tokens=6",
        "generation.top_k=1",
        *extra,
    ]


def stages(
    llava: Path, qwen: Path, files: dict[str, Path], stops: list[int], out: Path, ranks: int
) -> list:
    """The commands of the launch of `ranks` processes, each writing under `out`; with 2 the
    Qwen2-VL GRPO reference is partitioned too (a DeepSpeed engine, 1 rank has none)."""
    small = ["ppo.rollout_batch_size=4", "ppo.rollout_micro_batch_size=4"]
    # one prompt per decode chunk: a rank's chunk of an image-less prompt meets the
    # other rank's chunk with images
    every = ["ppo.rollout_batch_size=4", "ppo.rollout_micro_batch_size=2"]
    turns = [
        "generation.environment=vision_models:ImageObservation",
        "generation.max_turns=2",
        "generation.max_episode_tokens=96",
        f"generation.stop_token_ids={json.dumps(stops)}",
    ]
    lora = ["lora.enabled=true", "lora.r=4", "model.gradient_checkpointing=true"]
    reference = ["ppo.kl_coef=0.05"] + ["distributed.frozen_models=partition"] * (ranks > 1)
    q, g = "qwen_colour_reward", files["grpo"]
    common = [f"model.policy={qwen}", "run.log_every=1", *PER_MODULE[1:]]
    # every stage of one DeepSpeed launch has the same micro-batch size and accumulation
    # steps (the accelerate config's DeepSpeed file is filled once): 2 x 2 on 2 ranks
    preference = ["dpo.batch_size=8", "dpo.micro_batch_size=2", "dpo.epochs=2", "dpo.optim.lr=1e-2"]
    sft = ["sft.batch_size=8", "sft.micro_batch_size=2", "sft.epochs=2", "sft.optim.lr=1e-2"]
    sft.append("model.freeze_vision=false")  # the blank tower's backward too
    return [
        grpo(llava, files["llava"], out / "llava", "llava_colour_reward", *small),
        grpo(qwen, g, out / "qwen", q, *every, *PER_MODULE, *reference),
        grpo(qwen, g, out / "lora", q, *small, "ppo.iterations=1", *lora),
        grpo(qwen, g, out / "turns", q, *small, *PER_MODULE, *turns, "ppo.iterations=1"),
        ["sft", f"data.train={files['sft']}", f"run.output_dir={out / 'sft'}", *common, *sft],
        ["dpo", f"data.train={files['dpo']}", f"run.output_dir={out / 'dpo'}", *common]
        + preference,
    ]


NAMES = ("llava", "qwen", "lora", "turns", "sft", "dpo")
WEIGHTS = "model.safetensors"
ENV = {"PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """{"one": {stage: metrics rows}, "two": {...}, "work": the directory}: every stage on
    1 rank and under 2-rank ZeRO-3, the two launches at once."""
    work = tmp_path_factory.mktemp("dist_vision")
    llava = build_tiny_llava(work / "llava_model")
    qwen = build_tiny_qwen_vl(work / "qwen_model", "qwen2_vl")
    files = {"llava": llava_prompts(work), **qwen_files(work)}
    stops = every_other_word(qwen)
    commands = {
        w: json.dumps(stages(llava, qwen, files, stops, work / w, n))
        for w, n in (("one", 1), ("two", 2))
    }
    launches = [
        [sys.executable, str(STAGES), commands["one"]],
        launch_args(ENGINES["zero3"], free_port(), str(STAGES), commands["two"]),
    ]
    for code, out, err in run_all(launches, 600, [ENV, ENV]):
        if code != 0:
            pytest.fail(f"exited {code}\n{(out + err)[-6000:]}")
    rows = {w: {n: metrics_rows(work / w / n) for n in NAMES} for w in ("one", "two")}
    return rows | {"work": work, "qwen": qwen, "inputs": (llava, qwen, files, stops)}


def compared(row: dict) -> list[str]:
    return [
        k
        for k, v in row.items()
        if isinstance(v, (int, float)) and not k.startswith(UNTIMED) and not k.endswith(LAYOUT)
    ]


def assert_same_metrics(one: list[dict], two: list[dict]) -> None:
    assert one and [r["step"] for r in one] == [r["step"] for r in two]
    for a, b in zip(one, two):
        keys = compared(a)
        assert len(keys) > 5
        for k in keys:
            assert b[k] == pytest.approx(a[k], abs=1e-5, rel=1e-5), k


@pytest.mark.parametrize("stage", NAMES)
def test_two_ranks_give_the_one_rank_runs_metrics(runs, stage):
    assert_same_metrics(runs["one"][stage], runs["two"][stage])


@pytest.mark.skipif(
    os.environ.get(ALL_ENGINES) != "1", reason=f"an opt-in engine variant: {ALL_ENGINES}=1 runs it"
)
def test_fsdp2_gives_the_one_rank_runs_metrics(runs):
    """The Qwen2-VL stages under 2-rank FSDP2, whose units are Qwen-VL's vision blocks too
    (per-unit gathers: a rank without images runs the blank tower), with the 1-rank
    commands: the 1-rank run's metrics."""
    work, names = runs["work"], ("qwen", "turns", "sft", "dpo")
    commands = stages(*runs["inputs"], work / "fsdp2", 1)
    picked = json.dumps([c for c, n in zip(commands, NAMES) if n in names])
    launch = launch_args(ENGINES["fsdp2"], free_port(), str(STAGES), picked)
    ((code, out, err),) = run_all([launch], 600, [ENV])
    assert code == 0, (out + err)[-6000:]
    for name in names:
        assert_same_metrics(runs["one"][name], metrics_rows(work / "fsdp2" / name))


def test_the_updates_moved_the_weights(runs):
    for stage in ("llava", "qwen"):
        first, second = runs["one"][stage]
        assert first["optim/grad_norm_actor"] > 0
        # iteration 2 sampled with the updated weights: its entropy is not iteration 1's
        assert second["objective/entropy"] != pytest.approx(first["objective/entropy"], abs=1e-4)
    assert abs(runs["two"]["qwen"][0]["objective/kl"]) < 1e-6  # the partitioned reference


def test_trained_and_frozen_weights_of_the_two_rank_runs(runs):
    """The 2-rank exports: Qwen2-VL GRPO and DPO (tower frozen) trained the language model
    only; SFT (model.freeze_vision=false) trained the tower too, its backward run on a
    rank without images through the blank image."""
    original = load_file(str(runs["qwen"] / "model.safetensors"))
    two = runs["work"] / "two"
    for stage in ("qwen", "dpo"):
        assert_trained_language_only(original, load_file(str(two / stage / "final" / WEIGHTS)))
    sft = load_file(str(two / "sft" / "final" / WEIGHTS))
    assert any(not torch.equal(sft[k], t) for k, t in original.items() if is_vision_part(k))


def test_image_episodes_reached_the_observation_on_both_ranks(runs):
    (row,) = runs["two"]["turns"]
    assert 1 < row["rollout/turns"] <= 2  # some episodes took the image and answered it


def test_lora_with_checkpointing_trains_the_adapters_only(runs):
    """The 2-rank export: lora_B (0 at the start) moved; the merged weights are the
    original base plus the exported adapters, the vision tower untouched."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    out = runs["work"] / "two" / "lora"
    adapters = load_file(str(out / "final_adapter" / "adapter_model.safetensors"))
    assert any("lora_B" in k and t.abs().sum() > 0 for k, t in adapters.items())
    assert not any(is_vision_part(k) for k in adapters)
    base = AutoModelForImageTextToText.from_pretrained(str(runs["qwen"]))
    original = {k: v.clone() for k, v in base.state_dict().items()}
    merged = PeftModel.from_pretrained(base, str(out / "final_adapter")).merge_and_unload()
    exported = AutoModelForImageTextToText.from_pretrained(str(out / "final")).state_dict()
    for name, tensor in merged.state_dict().items():
        assert torch.allclose(exported[name], tensor, atol=1e-6), name
        if is_vision_part(name):
            assert torch.equal(exported[name], original[name]), name
