"""`rlhf-dist plan` against the measured peak of each phase, on CPU (issue 35 item 3).

A grid of random Llamas built here from their config (no download): 3 sizes x 2 sequence
lengths x {plain, LoRA, gradient checkpointing}. Each cell plans a one-actor GRPO run
(reward function, no reference, no critic) with `rlhf_dist.planning`, then runs the three
phases with the code the trainers run, one process, fp32, and measures each phase's peak
of tensor memory:

- generation: `engine.decode.generate` (LoRA: inside `merged_adapters`, as the rollout);
- scoring: `engine.forward.token_logprobs` without gradients, with entropies;
- update: `token_logprobs` with gradients on a micro-batch, a clipped-ratio loss,
  backward and the fused AdamW step of `trainers.common.make_optimizer`.

Measured as the profiler's allocation records (`profile_memory=True`: every allocation
and free of torch's CPU allocator, as tests/algo/test_algo_logprobs_hidden.py measures):
the peak of the running sum during the phase, plus the bytes held when it began (the
weights and the Adam moments of a first, unmeasured step). Prints estimate, measured and
their ratio per cell and phase; the target is within 15% everywhere. With `--device cuda`
(launch/bench/gpu_suite.sh's `plan` case) the same cells run on the GPU, fp32, measured
by torch.cuda.max_memory_allocated, planned with the GPU's fused attention.

    PYTHONPATH=. python launch/bench/plan_check.py [--sizes S M L] [--attn sdpa] [--out DIR]

`--autocast`: bf16 compute over fp32 weights, as a run without DeepSpeed at model.dtype=bfloat16
(runtime.autocast): generation and scoring in one autocast region, as the rollout runs, so
the bf16 weight copies autocast caches at generation stay through scoring; each update
forward in its own region, as Accelerate's prepared forward; LoRA over a bf16 base.

ZeRO-3 is not in the CPU grid: in one process ZeRO-3 partitions over one rank, i.e. the
plain cell's tensors; its per-rank division is the planner's arithmetic (the ZeRO paper's)
and is checked on GPUs by launch/bench/gpu_suite.sh's zero3 case (planned vs measured).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from rlhf_dist.config import LoRAConfig, OptimConfig, PerfConfig, load_config
from rlhf_dist.planning import GIB, Hardware, build_plan, read_shapes

SIZES = {  # hidden, layers, heads, kv heads, intermediate, vocabulary
    "S": (128, 2, 4, 2, 352, 4096),
    "M": (256, 4, 8, 2, 704, 8192),
    "L": (384, 6, 6, 2, 1024, 12288),
}
LENGTHS = ((32, 64), (128, 128))  # (prompt, response) tokens: sequences of 96 and 256
VARIANTS = ("plain", "lora", "checkpointing")
ROWS, MICRO = 8, 4  # sequences per rollout forward; per update micro-batch (2 per step)
PHASES = ("generation", "scoring", "update")


def build_model(size: str, attn: str, out: Path) -> Path:
    """A random Llama of `size`, its config.json saved under out/size (the planner's input)."""
    from transformers import LlamaConfig

    h, layers, heads, kv, inter, vocab = SIZES[size]
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, intermediate_size=inter, max_position_embeddings=1024,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        attn_implementation=attn,
    )  # fmt: skip
    path = out / size
    config.save_pretrained(str(path))
    return path


def overrides(path: Path, prompt: int, response: int, variant: str, attn: str) -> list[str]:
    return [
        f"model.policy={path}", "data.train=x", f"data.max_prompt_length={prompt}",
        f"generation.max_new_tokens={response}", f"generation.min_new_tokens={response}",
        "ppo.kl_coef=0", "reward.function=a:b", f"ppo.rollout_batch_size={ROWS}",
        f"ppo.rollout_micro_batch_size={ROWS}", f"ppo.micro_batch_size={MICRO}",
        f"model.gradient_checkpointing={variant == 'checkpointing'}",
        f"lora.enabled={variant == 'lora'}", f"model.attn_implementation={attn}",
        # measure() scores with the actor and samples 8 distinct prompts (nothing shared)
        "perf.old_logprobs_from_update=false", "perf.shared_prompt_forward=false",
    ]  # fmt: skip


def planned(path: Path, prompt: int, response: int, variant: str, attn: str, device: str = "cpu", autocast: bool = False) -> dict:  # fmt: skip
    """The plan's per-phase peaks of the cell (fp32, or bf16 autocast over fp32 weights)."""
    extra = [f"model.dtype={'bfloat16' if autocast else 'float32'}"]
    cfg = load_config(None, overrides(path, prompt, response, variant, attn) + extra, "grpo")
    hw = Hardware(gpus=1, memory=1024 * GIB, zero_stage=None, device=device)
    plan = build_plan(cfg, "ppo", read_shapes(cfg, "ppo"), hw)
    return {p.name: p.total for p in plan.phases}


def peak_during(step, device: str = "cpu") -> tuple[int, int]:
    """(the most bytes torch's allocator held at once during `step()`, the bytes still
    held when it returned), both over what it held when it began: on CPU from the
    profiler's allocation and free records (in time order), on a GPU from the caching
    allocator's own counters."""
    from torch.profiler import ProfilerActivity, profile

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before, torch.cuda.memory_allocated() - before

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = prof.profiler.kineto_results.events()
    deltas = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    held = peak = 0
    for _, nbytes in deltas:
        held += nbytes
        peak = max(peak, held)
    return peak, held


def held_bytes(model, optimizer) -> int:
    """Bytes of the tensors alive between phases: weights and optimizer states (unique
    storages; gradients are None after zero_grad(set_to_none=True))."""
    tensors = list(model.parameters()) + [
        t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)
    ]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def make_actor(path: Path, variant: str, device: str = "cpu", autocast: bool = False):
    """The actor as the trainer builds it: fp32 (under autocast a LoRA base is bf16),
    dropout off, LoRA adapters (fp32) or gradient checkpointing per the variant; and its
    fused AdamW."""
    from transformers import AutoConfig, LlamaForCausalLM

    from rlhf_dist.models.loading import (
        disable_dropout,
        enable_gradient_checkpointing,
        upcast_trainable,
    )
    from rlhf_dist.models.lora import add_adapters
    from rlhf_dist.trainers.common import make_optimizer

    torch.manual_seed(0)
    model = disable_dropout(LlamaForCausalLM(AutoConfig.from_pretrained(str(path)))).to(device)
    if variant == "lora":
        model = model.to(torch.bfloat16) if autocast else model
        model = upcast_trainable(add_adapters(model, LoRAConfig(enabled=True), "CAUSAL_LM"))
    if variant == "checkpointing":
        model = enable_gradient_checkpointing(model)
    return model, make_optimizer([(model.parameters(), OptimConfig())])


def batch(vocab: int, rows: int, prompt: int, response: int):
    """Left-padded prompts (rows, P) (row i has i mod 4 pads) and responses (rows, T)."""
    g = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(3, vocab, (rows, prompt), generator=g)
    prompt_mask = torch.ones(rows, prompt, dtype=torch.long)
    for i in range(rows):
        prompt_ids[i, : i % 4], prompt_mask[i, : i % 4] = 0, 0
    response_ids = torch.randint(3, vocab, (rows, response), generator=g)
    return prompt_ids, prompt_mask, response_ids


def update_step(model, optimizer, ids, mask, predict, prompt: int, perf: PerfConfig, region) -> None:  # fmt: skip
    """One optimizer step of the update over ROWS sequences in micro-batches of MICRO:
    log-probs and entropies with gradients (each forward inside `region()`), the
    clipped-ratio loss against detached old log-probs, backward per micro-batch
    (gradients accumulate), then the AdamW step."""
    from rlhf_dist.engine.forward import token_logprobs

    model.train()
    for start in range(0, ids.shape[0], MICRO):
        part = slice(start, start + MICRO)
        with region():
            lp, entropy = token_logprobs(
                model, ids[part], mask[part], predict[part], 1.0, True, prompt, perf
            )
        adv = torch.linspace(-1, 1, lp.shape[0], device=lp.device)[:, None].expand_as(lp)
        ratio = torch.exp(lp - lp.detach())
        loss = -(torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv) * predict[part]).sum()
        (loss / predict.sum() - 0.01 * entropy.mean()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure(path: Path, prompt: int, response: int, variant: str, device: str = "cpu", autocast: bool = False) -> dict:  # fmt: skip
    """Each phase's measured peak (bytes) of the cell's actor. Under `autocast`, scoring
    follows generation in the same region and starts with what generation left held."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    from rlhf_dist.engine.decode import generate
    from rlhf_dist.engine.forward import token_logprobs
    from rlhf_dist.models.lora import merged_adapters

    model, optimizer = make_actor(path, variant, device, autocast)

    def region():
        return torch.autocast(device, dtype=torch.bfloat16) if autocast else nullcontext()

    vocab = SIZES[path.name][5]
    # MKL-packed decode weights (perf.packed_linears) are CPU-only copies whose size MKL
    # decides (~25x the weights of these narrow layers): off, as the planner is for GPUs
    perf = PerfConfig(packed_linears=False)
    prompt_ids, prompt_mask, response_ids = (
        t.to(device) for t in batch(vocab, ROWS, prompt, response)
    )
    ids = torch.cat([prompt_ids, response_ids], 1)
    mask = torch.cat([prompt_mask, torch.ones_like(response_ids)], 1)
    predict = torch.ones_like(response_ids, dtype=torch.bool)
    micro = (ids, mask, predict)
    update_step(model, optimizer, *micro, prompt, perf, region)  # Adam's moments exist from here
    base = held_bytes(model, optimizer)
    sampling = SimpleNamespace(max_new_tokens=response, min_new_tokens=response,
                               temperature=1.0, top_k=0, top_p=1.0)  # fmt: skip
    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=2)

    def generation():
        model.eval()
        context = merged_adapters(model) if variant == "lora" else _nothing(model)
        with context as actor:
            generate(actor, prompt_ids, prompt_mask, sampling, tokenizer, perf=perf)

    def scoring():
        model.eval()
        with torch.no_grad():
            token_logprobs(model, ids, mask, predict, 1.0, True, prompt, perf)

    peaks = {}
    with region():  # the rollout: one region for sampling and scoring (trainers/ppo.py)
        peaks["generation"], left = peak_during(generation, device)
        peaks["scoring"] = left + peak_during(scoring, device)[0]
    update = lambda: update_step(model, optimizer, *micro, prompt, perf, region)  # noqa: E731
    peaks["update"] = peak_during(update, device)[0]
    return {name: base + peak for name, peak in peaks.items()}


class _nothing:
    def __init__(self, model):
        self.model = model

    def __enter__(self):
        return self.model

    def __exit__(self, *exc):
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"))
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--autocast", action="store_true", help="bf16 autocast over fp32 weights")
    ap.add_argument("--out", type=Path, help="write the rows as JSON here too")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows, worst = [], 0.0
    print(f"{'cell':<28} {'phase':<11} {'plan MiB':>9} {'measured MiB':>13} {'ratio':>6}")
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            path = build_model(size, args.attn, Path(tmp))
            for prompt, response in LENGTHS:
                for variant in args.variants:
                    start = time.perf_counter()
                    plan = planned(path, prompt, response, variant, args.attn, args.device, args.autocast)  # fmt: skip
                    got = measure(path, prompt, response, variant, args.device, args.autocast)
                    cell = f"{size} P{prompt}+T{response} {variant}"
                    for phase in PHASES:
                        ratio = plan[phase] / got[phase]
                        worst = max(worst, abs(ratio - 1))
                        rows.append({"cell": cell, "phase": phase, "plan": plan[phase],
                                     "measured": got[phase], "ratio": ratio})  # fmt: skip
                        print(f"{cell:<28} {phase:<11} {plan[phase] / 2**20:>9.1f} "
                              f"{got[phase] / 2**20:>13.1f} {ratio:>6.2f}")  # fmt: skip
                    print(f"{'':<28} ({time.perf_counter() - start:.1f} s)", flush=True)
    print(f"worst |plan / measured - 1| = {worst:.1%} over {len(rows)} cells x phases")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
