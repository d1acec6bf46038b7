"""`rlhf-dist demo --task vision`: a tiny Qwen2-VL (demo/vision_model.py) learns the colour of
the shape in a generated image (demo/vision_task.py; docs/vision.md, "The vision demo").

Steps: build the random model with its processor; held-out accuracy under greedy decoding;
SFT on rows labelled by a biased annotator (`vision_task.SWAPS`), which teaches the answer
format, three colours and the annotator's swaps of the other three; GRPO on unlabelled
prompts with `colour_reward`, which checks the truth;
held-out accuracy after each stage and the GRPO policy's KL to the SFT policy, printed as
the text demo prints its results. The vision tower is trained (`model.freeze_vision`
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
NEW_TOKENS = 3  # a colour word, <|im_end|>, one spare
KL_SAMPLES = 4  # responses per held-out row in the KL estimate
QUICK_SFT_ROWS = 32  # --quick: a smoke test of every stage


def vision_stage_trees(root: Path, policy: Path, seed: int, quick: bool) -> dict[str, dict]:
    """The SFT and GRPO config trees: SFT 6 epochs of the labelled rows in batches of 16,
    GRPO 60 iterations of 8 prompts x 8 samples, lr 3e-4 (docs/vision.md: 1e-4 gained
    less), 3 new tokens at temperature 1 (one colour word and the end of turn); quick: 1
    epoch and 2 iterations."""
    model = {"policy": str(policy), "freeze_vision": False}
    sft = {"batch_size": 16, "micro_batch_size": 16, "epochs": 1 if quick else 6}
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
            "generation": {"max_new_tokens": NEW_TOKENS, "temperature": 1.0},
            "run": {"output_dir": str(root / "grpo"), "seed": seed},
        },
    }


def _load(path: Path) -> tuple[Any, Any]:
    """The model saved at `path` (fp32, eval mode) and its processor."""
    import torch
    from transformers import AutoModelForImageTextToText

    from rlhf_dist.models.qwen_vl import load_processor

    model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32)
    return model.eval(), load_processor(path)


def _prompt_inputs(processor: Any, rows: list[dict[str, Any]]) -> Any:
    """The processor's inputs for prompt rows: left-padded ids (B, P), attention mask,
    mm_token_type_ids, pixel values and image grids."""
    texts = [
        processor.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
        for r in rows
    ]
    images = [[r["image"]] for r in rows]
    return processor(text=texts, images=images, padding=True, return_tensors="pt")


def greedy_accuracy(path: Path, rows: list[dict[str, Any]]) -> float:
    """Held-out accuracy of the model saved at `path`: transformers' greedy `generate`
    (3 new tokens; the model's own M-RoPE rule) scored by `vision_task.accuracy`."""
    import torch

    model, processor = _load(path)

    def answers(batch: list[dict[str, Any]]) -> list[str]:
        inputs = _prompt_inputs(processor, batch)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
        new = out[:, inputs["input_ids"].shape[1] :]
        return list(processor.batch_decode(new, skip_special_tokens=True))

    return task.accuracy(answers, rows)


def _response_logprobs(model: Any, inputs: Any, sequences: Any, mask: Any) -> Any:
    """(B, T) log-probs under `model` of the response tokens sequences[:, P:] (B, P + T), the
    prompts' images in the forward; mask (B, T) bool: the response tokens attended to."""
    import torch

    prompt_len = inputs["input_ids"].shape[1]
    types = (sequences == model.config.image_token_id).long()  # 1 on image tokens
    with torch.no_grad():
        logits = model(
            input_ids=sequences,
            attention_mask=torch.cat([inputs["attention_mask"], mask.long()], 1),
            mm_token_type_ids=types,
            pixel_values=inputs["pixel_values"],
            image_grid_thw=inputs["image_grid_thw"],
        ).logits[:, prompt_len - 1 : -1]
    picked = sequences[:, prompt_len:, None]
    return torch.log_softmax(logits.float(), -1).gather(-1, picked).squeeze(-1)


def kl_to_sft(
    policy: Path, sft: Path, rows: list[dict[str, Any]], temperature: float, seed: int
) -> float:
    """KL(pi || pi_SFT) in nats per response, as the text demo reports it (evaluate.py):
    KL_SAMPLES responses per row sampled from `policy` at `temperature`, the k1 estimate
    log pi - log pi_SFT summed over each response's tokens up to and including its first
    <|im_end|>, averaged over responses. A sampled <|image_pad|> is suppressed, as the
    rollout cuts it: that token has no image features for the scoring forward."""
    import torch

    model, processor = _load(policy)
    reference, _ = _load(sft)
    inputs = _prompt_inputs(processor, [r for r in rows for _ in range(KL_SAMPLES)])
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=NEW_TOKENS, do_sample=True, temperature=temperature,
            top_k=0, top_p=1.0, suppress_tokens=[model.config.image_token_id],
        )  # fmt: skip
    is_eos = out[:, inputs["input_ids"].shape[1] :] == processor.tokenizer.eos_token_id
    mask = (is_eos.long().cumsum(1) - is_eos.long()) == 0  # (B, T): through the first EOS
    ratio = _response_logprobs(model, inputs, out, mask)
    ratio = ratio - _response_logprobs(reference, inputs, out, mask)
    return float((ratio * mask).sum(1).mean())


def run_vision_demo(
    output_dir: str, seed: int = 0, quick: bool = False, overrides: Sequence[str] = ()
) -> dict[str, Any]:
    """Build, evaluate, SFT, evaluate, GRPO, evaluate; returns (and writes) DIR/summary.json
    (the three held-out accuracies, the GRPO policy's KL to the SFT one, each stage's
    seconds) and prints the results block."""
    import rlhf_dist
    from rlhf_dist.demo.vision_model import build_tiny_qwen_vl

    root, start = Path(output_dir), time.time()
    trees = with_overrides(vision_stage_trees(root, root / "base", seed, quick), overrides)
    held_out = task.held_out_rows(16 if quick else HELD_OUT)
    sft, grpo = root / "sft" / "final", root / "grpo" / "final"
    sft_rows = task.sft_rows(QUICK_SFT_ROWS if quick else task.SFT_ROWS)
    s: dict[str, Any] = {"held_out_rows": len(held_out), "seconds": {}}
    s |= _settings(trees, len(sft_rows))
    # 1. The random model and its held-out accuracy (chance: 1 / 6 colours).
    print(f"== vision demo: stage 1/3, the untrained model on {len(held_out)} held-out images")
    s["accuracy_base"] = greedy_accuracy(build_tiny_qwen_vl(root / "base", seed=seed), held_out)
    # 2. SFT on the annotator's rows: the format, three colours, the annotator's swaps.
    print(f"== stage 2/3: SFT, {s['sft_steps']} steps on {s['sft_rows']} labelled rows")
    rlhf_dist.sft(trees["sft"], dataset=sft_rows)
    s["accuracy_sft"] = greedy_accuracy(sft, held_out)
    s["seconds"]["sft"] = round(time.time() - start, 1)
    # 3. GRPO on unlabelled prompts, the reward checking the colour; the KL it moved.
    print(f"== stage 3/3: GRPO, {s['grpo_iterations']} iterations (SFT: {s['accuracy_sft']:.3f})")
    ppo = trees["grpo"]["ppo"]
    prompts = task.prompt_rows(ppo["rollout_batch_size"] * ppo["iterations"])
    rlhf_dist.grpo(trees["grpo"], dataset=prompts, reward_fn=task.colour_reward)
    s["accuracy_grpo"] = greedy_accuracy(grpo, held_out)
    temperature = trees["grpo"]["generation"]["temperature"]
    s["kl_to_sft"] = kl_to_sft(grpo, sft, held_out, temperature, seed)
    s["seconds"]["grpo"] = round(time.time() - start - s["seconds"]["sft"], 1)
    s["wall_seconds"] = round(time.time() - start, 1)
    (root / "summary.json").write_text(json.dumps(s, indent=2) + "\n", encoding="utf-8")
    print(format_vision(s, root))
    return s


def _settings(trees: dict[str, dict], sft_rows: int) -> dict[str, int]:
    """The stages' sizes the summary reports: SFT rows and optimizer steps, GRPO iterations, and
    prompts x samples per iteration."""
    sft, ppo = trees["sft"]["sft"], trees["grpo"]["ppo"]
    return {
        "sft_rows": sft_rows,
        "sft_steps": sft["epochs"] * -(-sft_rows // sft["batch_size"]),
        "grpo_iterations": ppo["iterations"],
        "grpo_prompts": ppo["rollout_batch_size"],
        "grpo_samples": ppo["samples_per_prompt"],
    }


def format_vision(s: dict[str, Any], root: Path) -> str:
    """The results block, laid out as the text demo's (pipeline.format_summary)."""
    gain = s["accuracy_grpo"] - s["accuracy_sft"]
    return "\n".join(
        [
            "",
            f"== demo results ({s['held_out_rows']} held-out images, greedy; accuracy = the "
            "first word names the shape's colour)",
            f"   accuracy      untrained {s['accuracy_base']:.3f}  ->  SFT {s['accuracy_sft']:.3f}"
            f"  ->  GRPO {s['accuracy_grpo']:.3f} ({gain:+.3f})",
            f"   KL to SFT     GRPO {s['kl_to_sft']:.2f} nats per response",
            f"   wall time     {s['wall_seconds']:.0f} s (SFT {s['sft_steps']} steps on "
            f"{s['sft_rows']} labelled rows; GRPO {s['grpo_iterations']} iterations of "
            f"{s['grpo_prompts']} prompts x {s['grpo_samples']} samples)",
            f"   summary: {root / 'summary.json'}",
        ]
    )
