"""Is the vision demo task (rlhf_dist/demo/vision_task.py) learnable by a tiny vision-language
model on 2 CPU cores in minutes? Plain transformers + torch, no rlhf_dist trainer: SFT on
labelled rows, then greedy held-out accuracy (docs/vision.md, "The vision demo task").

    python launch/bench/vision_task_learnable.py                 # SFT, 512 rows, whole palette
    python launch/bench/vision_task_learnable.py --rows 48 --batch 8 --steps 40 --grpo-steps 60
    python launch/bench/vision_task_learnable.py --colours half --steps 100 --grpo-steps 20

Prints one JSON line per evaluation: step, seconds, loss, held-out accuracy, the answers' counts.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the checkout; tests/vision_models.py

from vision_models import build_tiny_qwen_vl  # noqa: E402

from rlhf_dist.demo import vision_task as task  # noqa: E402
from rlhf_dist.models.qwen_vl import load_processor  # noqa: E402


def sft_batch(processor, rows):
    """Processor outputs for full conversations, labels -100 except the assistant's answer
    and its <|im_end|> (the prompt with the generation prompt is the masked prefix)."""
    prompts = [
        processor.apply_chat_template(r["messages"][:1], add_generation_prompt=True, tokenize=False)
        for r in rows
    ]
    answers = [r["messages"][1]["content"][0]["text"] + "<|im_end|>" for r in rows]
    images = [r["images"] for r in rows]
    processor.tokenizer.padding_side = "right"
    batch = processor(
        text=[p + a for p, a in zip(prompts, answers)],
        images=images,
        padding=True,
        return_tensors="pt",
    )
    processor.tokenizer.padding_side = "left"
    plain = processor(text=prompts, images=images, padding=True, return_tensors="pt")
    labels = batch["input_ids"].clone()
    for i, n in enumerate(plain["attention_mask"].sum(1).tolist()):
        labels[i, :n] = -100
    labels[batch["attention_mask"] == 0] = -100
    return batch, labels


@torch.no_grad()
def greedy_answers(model, processor, rows, max_new_tokens: int = 3) -> list[str]:
    texts = [
        processor.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
        for r in rows
    ]
    batch = processor(
        text=texts, images=[[r["image"]] for r in rows], padding=True, return_tensors="pt"
    )
    out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False)
    return processor.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)


def grpo_step(model, processor, optimizer, rows, group: int) -> float:
    """One on-policy GRPO step in its simplest form (Shao et al. 2024, eq. 3 with one update per
    sample, so the ratio is 1, no KL, Dr. GRPO's mean-only baseline): `group` samples per
    prompt at temperature 1, advantage = reward - the group's mean, loss = -advantage x the
    completion's log-prob summed over its tokens, averaged over tokens. Returns the mean reward."""
    repeated = [r for r in rows for _ in range(group)]
    texts = [
        processor.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
        for r in repeated
    ]
    batch = processor(
        text=texts, images=[[r["image"]] for r in repeated], padding=True, return_tensors="pt"
    )
    with torch.no_grad():
        # a sampled vision token would be a placeholder without features: the forward refuses it
        vision = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
        suppress = processor.tokenizer.convert_tokens_to_ids(vision)
        out = model.generate(
            **batch,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            max_new_tokens=2,
            suppress_tokens=suppress,
        )
    prompt_len = batch["input_ids"].shape[1]
    completion = out[:, prompt_len:]
    eos = processor.tokenizer.eos_token_id
    after_eos = (completion == eos).long().cumsum(1) - (
        completion == eos
    ).long()  # >0 after the first EOS
    keep = (after_eos == 0).long()
    texts_out = processor.batch_decode(completion, skip_special_tokens=True)
    rewards = torch.tensor(task.colour_reward(texts_out, [r["answer"] for r in repeated]))
    advantages = (rewards.view(-1, group) - rewards.view(-1, group).mean(1, keepdim=True)).view(-1)
    logits = model(
        input_ids=out,
        attention_mask=torch.cat([batch["attention_mask"], keep], 1),
        mm_token_type_ids=torch.cat([batch["mm_token_type_ids"], torch.zeros_like(completion)], 1),
        pixel_values=batch["pixel_values"],
        image_grid_thw=batch["image_grid_thw"],
    ).logits[:, prompt_len - 1 : -1]
    logprobs = (
        torch.log_softmax(logits.float(), -1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
    )
    loss = -(advantages[:, None] * logprobs * keep).sum() / keep.sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return rewards.mean().item()


def evaluate(model, processor, rows) -> tuple[float, dict[str, int]]:
    model.eval()
    answers = []
    for i in range(0, len(rows), 32):
        answers += greedy_answers(model, processor, rows[i : i + 32])
    model.train()
    counts = collections.Counter(task.answer_of(a) or "other" for a in answers)
    return task.accuracy(lambda _: answers, rows), dict(counts)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--colours", choices=("all", "half"), default="all")
    parser.add_argument("--model-type", default="qwen2_vl")
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--held-out", type=int, default=192)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--freeze-vision", action="store_true")
    parser.add_argument("--grpo-steps", type=int, default=0)
    parser.add_argument("--grpo-lr", type=float, default=3e-4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    args = parser.parse_args()
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    path = build_tiny_qwen_vl(Path(tempfile.mkdtemp()) / "model", args.model_type)
    processor = load_processor(path)
    model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32)
    if args.freeze_vision:
        model.model.visual.requires_grad_(False)
    colours = tuple(task.COLOURS)[: 6 if args.colours == "all" else 3]
    rows = task.sft_rows(args.rows, colours=colours)
    held_out = task.held_out_rows(args.held_out)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    start, losses = time.time(), []
    for step in range(args.steps + 1):
        if step % args.eval_every == 0:
            accuracy, counts = evaluate(model, processor, held_out)
            loss = sum(losses[-20:]) / max(1, len(losses[-20:]))
            seconds = round(time.time() - start, 1)
            print(json.dumps({"step": step, "s": seconds, "loss": round(loss, 4), "held_out_accuracy": accuracy, "answers": counts}), flush=True)  # fmt: skip
        if step == args.steps:
            break
        picked = [rows[(step * args.batch + i) % len(rows)] for i in range(args.batch)]
        batch, labels = sft_batch(processor, picked)
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=args.grpo_lr
    )
    prompts = task.prompt_rows(args.grpo_steps * args.prompts)
    rewards: list[float] = []
    for step in range(1, args.grpo_steps + 1):
        picked = prompts[(step - 1) * args.prompts : step * args.prompts]
        rewards.append(grpo_step(model, processor, optimizer, picked, args.group))
        if step % args.eval_every == 0 or step == args.grpo_steps:
            accuracy, counts = evaluate(model, processor, held_out)
            reward = round(sum(rewards[-10:]) / len(rewards[-10:]), 3)
            seconds = round(time.time() - start, 1)
            print(json.dumps({"grpo_step": step, "s": seconds, "reward": reward, "held_out_accuracy": accuracy, "answers": counts}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
