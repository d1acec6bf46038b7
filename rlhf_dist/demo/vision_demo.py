"""`rlhf-dist demo --task vision`: a tiny Qwen2-VL (demo/vision_model.py) learns the colour of
the shape in a generated image (demo/vision_task.py; docs/vision.md, "The vision demo").

Steps: build the random model with its processor; held-out accuracy under greedy decoding;
SFT on the small labelled subset (`vision_task.SFT_ROWS` rows), which teaches the answer
format and part of the mapping; GRPO on many unlabelled prompts with `colour_reward`;
held-out accuracy after each stage. The vision tower is trained (`model.freeze_vision`
false): it is random here, and frozen it caps what the task can reach.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlhf_dist.demo import vision_task as task
from rlhf_dist.demo.pipeline import with_overrides

HELD_OUT = 96  # held-out rows, every colour


def vision_stage_trees(root: Path, policy: Path, seed: int, quick: bool) -> dict[str, dict]:
    """The SFT and GRPO config trees: SFT 7 epochs of the labelled rows in batches of 8,
    GRPO 60 iterations of 8 prompts x 8 samples, lr 3e-4 (docs/vision.md: 1e-4 and 1e-3
    gained less), 3 new tokens at temperature 1 (one colour word and the end of turn);
    quick: 1 epoch and 2 iterations."""
    model = {"policy": str(policy), "freeze_vision": False}
    sft = {"batch_size": 8, "micro_batch_size": 8, "epochs": 1 if quick else 7}
    ppo = {
        "iterations": 2 if quick else 60,
        "rollout_batch_size": 8,
        "samples_per_prompt": 8,
        "minibatch_size": 64,
        "micro_batch_size": 32,
        "optim": {"lr": 3e-4},
    }
    return {
        "sft": {
            "model": model,
            "sft": sft | {"optim": {"lr": 1e-3}},
            "run": {"output_dir": str(root / "sft"), "seed": seed},
        },
        "grpo": {
            "model": model | {"policy": str(root / "sft" / "final")},
            "ppo": ppo,
            "generation": {"max_new_tokens": 3, "temperature": 1.0},
            "run": {"output_dir": str(root / "grpo"), "seed": seed},
        },
    }


def greedy_accuracy(path: Path, rows: list[dict[str, Any]]) -> float:
    """Held-out accuracy of the model saved at `path`: transformers' greedy `generate`
    (3 new tokens; the model's own M-RoPE rule) scored by `vision_task.accuracy`."""
    import torch
    from transformers import AutoModelForImageTextToText

    from rlhf_dist.models.qwen_vl import load_processor

    model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32).eval()
    processor = load_processor(path)

    def answers(batch: list[dict[str, Any]]) -> list[str]:
        texts = [
            processor.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
            for r in batch
        ]
        images = [[r["image"]] for r in batch]
        inputs = processor(text=texts, images=images, padding=True, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
        new = out[:, inputs["input_ids"].shape[1] :]
        return list(processor.batch_decode(new, skip_special_tokens=True))

    return task.accuracy(answers, rows)


def run_vision_demo(
    output_dir: str, seed: int = 0, quick: bool = False, overrides: Sequence[str] = ()
) -> dict[str, Any]:
    """Build, evaluate, SFT, evaluate, GRPO, evaluate; returns (and writes) DIR/summary.json
    with the three held-out accuracies and each stage's seconds."""
    import rlhf_dist
    from rlhf_dist.demo.vision_model import build_tiny_qwen_vl

    root, start = Path(output_dir), time.time()
    base = build_tiny_qwen_vl(root / "base", seed=seed)
    trees = with_overrides(vision_stage_trees(root, base, seed, quick), overrides)
    held_out = task.held_out_rows(16 if quick else HELD_OUT)
    summary: dict[str, Any] = {"held_out_rows": len(held_out), "seconds": {}}
    summary["accuracy_base"] = greedy_accuracy(base, held_out)
    print(f"== vision demo: held-out accuracy, untrained: {summary['accuracy_base']:.3f}")
    rlhf_dist.sft(trees["sft"], dataset=task.sft_rows())
    summary["seconds"]["sft"] = round(time.time() - start, 1)
    summary["accuracy_sft"] = greedy_accuracy(root / "sft" / "final", held_out)
    print(f"== held-out accuracy after SFT ({task.SFT_ROWS} rows): {summary['accuracy_sft']:.3f}")
    prompts = task.prompt_rows(8 * trees["grpo"]["ppo"]["iterations"])
    rlhf_dist.grpo(trees["grpo"], dataset=prompts, reward_fn=task.colour_reward)
    summary["seconds"]["grpo"] = round(time.time() - start - summary["seconds"]["sft"], 1)
    summary["accuracy_grpo"] = greedy_accuracy(root / "grpo" / "final", held_out)
    gain = summary["accuracy_grpo"] - summary["accuracy_sft"]
    print(f"== held-out accuracy after GRPO: {summary['accuracy_grpo']:.3f} ({gain:+.3f})")
    (root / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return summary
