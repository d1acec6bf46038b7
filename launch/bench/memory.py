"""Memory benchmarks, one check per subcommand (run in the project's .venv):

  plan        `rlhf-dist plan`'s estimate against each phase's measured peak (one process)
  plan-zero3  the same on 2 CPU ranks under ZeRO-3 (launches itself per cell)
  vocab       time and memory of a PPO iteration with a real vocabulary's LM head
  sp          per-rank memory of an SFT step with sequence parallelism (under accelerate)
  sync        the weight sync to a rollout server under ZeRO-3, per bucket size

Usage: python launch/bench/memory.py CHECK [ARGS...]   (each CHECK's --help; the section of
each below has its details). docs/benchmarks.md has the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager, suppress
from pathlib import Path

import torch
import yaml
from harness import TOKEN_ENV, start_server

from rlhf_dist.api import end_process
from rlhf_dist.config import LoRAConfig, OptimConfig, PerfConfig, load_config
from rlhf_dist.data.batching import BatchPlan
from rlhf_dist.data.rows import SFTExample
from rlhf_dist.demo import arithmetic_demo, smollm2
from rlhf_dist.distributed import Runtime, seed_everything
from rlhf_dist.distributed.weight_sync import free_port, weight_buckets
from rlhf_dist.models import quiet_transformers
from rlhf_dist.planning import GIB, Hardware, build_plan, read_shapes
from rlhf_dist.trainers.common import make_optimizer
from rlhf_dist.trainers.sft import sft_step

REPO = Path(__file__).resolve().parents[2]


# ==============================================================================================
# plan: the planner against measured peaks, one process
# `rlhf-dist plan` against the measured peak of each phase, on CPU (issue 35 item 3).
#
# A grid of random Llamas built here from their config (no download): 3 sizes x 2 sequence
# lengths x {plain, LoRA, gradient checkpointing}. Each cell plans a one-actor GRPO run
# (reward function, no reference, no critic) with `rlhf_dist.planning`, then runs the three
# phases with the code the trainers run, one process, fp32, and measures each phase's peak
# of tensor memory:
#
# - generation: `engine.decode.generate` (LoRA: inside `merged_adapters`, as the rollout);
# - scoring: `engine.forward.token_logprobs` without gradients, with entropies;
# - update: `token_logprobs` with gradients on a micro-batch, a clipped-ratio loss,
#   backward and the fused AdamW step of `trainers.common.make_optimizer`.
#
# Measured as the profiler's allocation records (`profile_memory=True`: every allocation
# and free of torch's CPU allocator, as tests/algo/test_algo_logprobs_hidden.py measures):
# the peak of the running sum during the phase, plus the bytes held when it began (the
# weights and the Adam moments of a first, unmeasured step). Prints estimate, measured and
# their ratio per cell and phase; the target is within 15% everywhere. With `--device cuda`
# (launch/bench/gpu_suite.sh's `plan` case) the same cells run on the GPU, fp32, measured
# by torch.cuda.max_memory_allocated, planned with the GPU's fused attention.
#
#     PYTHONPATH=. python launch/bench/memory.py plan [--sizes S M L] [--attn sdpa] [--out DIR]
#
# `--autocast`: bf16 compute over fp32 weights, as a run without DeepSpeed at model.dtype=bfloat16
# (runtime.autocast): generation and scoring in one autocast region, as the rollout runs, so
# the bf16 weight copies autocast caches at generation stay through scoring; each update
# forward in its own region, as Accelerate's prepared forward; LoRA over a bf16 base.
#
# ZeRO-3 is not in the CPU grid: in one process ZeRO-3 partitions over one rank, i.e. the
# plain cell's tensors; its per-rank division is the planner's arithmetic (the ZeRO paper's)
# and is checked on GPUs by launch/bench/gpu_suite.sh's zero3 case (planned vs measured).


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
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlhf_dist.models.loading import (
        disable_dropout,
        enable_gradient_checkpointing,
        upcast_trainable,
    )
    from rlhf_dist.models.lora import add_adapters
    from rlhf_dist.trainers.common import make_optimizer

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(str(path))  # a Llama, or a MoE cell's Qwen3-MoE
    model = disable_dropout(AutoModelForCausalLM.from_config(config)).to(device)
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


def plan_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(
        description="`rlhf-dist plan` against the measured peak of each phase, on CPU (issue 35 item 3)."
    )
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"))
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--autocast", action="store_true", help="bf16 autocast over fp32 weights")
    ap.add_argument("--out", type=Path, help="write the rows as JSON here too")
    args = ap.parse_args(argv)
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


# ==============================================================================================
# plan-zero3: the planner against measured peaks, 2 ranks under ZeRO-3
# `rlhf-dist plan` against measured per-rank peaks under ZeRO-3 on 2 CPU ranks (issue 35).
#
# `plan`'s grid runs the phases in one process, where ZeRO-3 partitions over one
# rank. Here each cell is a real GRPO run (`rlhf_dist.api.grpo`, 2 iterations) launched
# with `accelerate launch --config_file accelerate_configs/cpu_zero3.yaml` (2 processes,
# DeepSpeed ZeRO-3 over gloo), on `plan`'s random Llamas (sizes S, M, L) and
# sequence lengths, with a word-level tokenizer of the model's whole vocabulary and prompts
# of exactly P tokens. Each rank samples 8 sequences (1 prompt x 8) of exactly T tokens
# (min_new_tokens = max_new_tokens) and updates in 2 micro-batches of 4, fp32.
#
# Variants: `zero3` (the defaults: on CPU the whole actor is gathered once for the rollout
# and once per optimizer step, perf.gather_for_*), `zero3-layers` (both gathers off:
# ZeRO-3's per-layer fetches in every forward and backward), `zero3-lora` (LoRA adapters),
# `zero3-kl` (a KL penalty: the frozen reference scores every rollout, placed as
# distributed.frozen_models=auto decides).
#
# Measured, per rank, as `plan` measures: torch's CPU allocator's allocation and free
# records (`profile_memory=True`), here from before the model exists, so their running sum
# is the bytes held; each phase's peak is that sum's maximum between the phase's markers in
# the second iteration (the first creates Adam's moments). Phases: generation (sampling,
# inside the rollout's whole-weights span), scoring (the scoring forwards) and the update
# (`ppo_update`). The plan is the run's own (planned_phases with the run's Hardware: 2 ranks,
# ZeRO-3, the host's memory shared by the ranks), computed in the run as its metrics do.
#
#     PYTHONPATH=. python launch/bench/memory.py plan-zero3 [--sizes S M L] [--variants ...] [--out rows.json]
#
# `--engine fsdp2` launches the same cells with accelerate_configs/cpu_fsdp2.yaml (issue 52):
# the run's plan is then FSDP2's (Runtime.engine), against the same counted peaks.
# `--probe` splits each cell's update peak (rank 0): the bytes held at every edge of the
# model's and its decoder layers' forwards and backwards, and the bytes autograd saves per
# forward and module (docs/distributed.md "Planning memory" cites it for FSDP2).


ZERO3_VARIANTS = {
    "zero3": [],
    "zero3-layers": ["perf.gather_for_generation=false", "perf.gather_for_training=never"],
    "zero3-lora": ["lora.enabled=true"],
    "zero3-kl": ["ppo.kl_coef=0.05"],
}


SAMPLES = 8  # sequences per rank: 1 prompt x 8 samples, as `plan`'s ROWS


def build_assets(size: str, prompt: int, out: Path) -> tuple[Path, Path]:
    """A random Llama of `size` with a word-level tokenizer over its whole vocabulary
    ("<pad>" 0, "<eos>" 1, "<bos>" 2, "<unk>" 3, then w4...), and 16 prompts of `prompt`
    words (one token each)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    h, layers, heads, kv, inter, vocab = SIZES[size]
    path = out / size
    if not (path / "config.json").exists():
        specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
        words = specials + [f"w{i}" for i in range(len(specials), vocab)]
        backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))  # fmt: skip
        backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        backend.add_special_tokens(specials)
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
            unk_token="<unk>", padding_side="right", model_max_length=1024,
        )  # fmt: skip
        config = LlamaConfig(
            vocab_size=vocab, hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=kv, intermediate_size=inter, max_position_embeddings=1024,
            tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=2,
        )  # fmt: skip
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(str(path))
        tokenizer.save_pretrained(str(path))
    rng = random.Random(prompt)
    prompts = out / f"prompts_{size}_{prompt}.jsonl"
    rows = [{"prompt": " ".join(f"w{rng.randrange(4, vocab)}" for _ in range(prompt))} for _ in range(16)]  # fmt: skip
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, prompts


def zero3_overrides(path: Path, prompts: Path, prompt: int, response: int, out: Path) -> list[str]:
    return [
        f"model.policy={path}", f"data.train={prompts}", f"data.max_prompt_length={prompt}",
        f"generation.max_new_tokens={response}", f"generation.min_new_tokens={response}",
        "ppo.kl_coef=0", "ppo.iterations=2", "ppo.rollout_batch_size=2",
        f"ppo.samples_per_prompt={SAMPLES}", f"ppo.rollout_micro_batch_size={SAMPLES}",
        "ppo.micro_batch_size=4", "model.dtype=float32", "model.attn_implementation=sdpa",
        "perf.packed_linears=false", f"run.output_dir={out}",
    ]  # fmt: skip


def zero3_reward(prompts, responses):
    """Varied scores so the groups are not tied: the share of even-numbered words."""
    return [sum(int(w[1:]) % 2 == 0 for w in r.split()) / max(1, len(r.split())) for r in responses]  # fmt: skip


# ------------------------------------------------------------------ inside one launched rank
def bracket(module, attr: str, phase: str, record: dict) -> None:
    """Wrap module.attr: each call appends (bytes held when it began, the peak during it)
    to record[phase]."""
    inner = getattr(module, attr)

    def wrapped(*args, **kwargs):
        cpu_reset_peak()
        start = cpu_held()
        try:
            return inner(*args, **kwargs)
        finally:
            record.setdefault(phase, []).append((start, cpu_peak()))

    setattr(module, attr, wrapped)


def probe_update(ppo_module, record: dict) -> None:
    """--probe: the measured (second) ppo_update call also records where its peak lies, in
    record["probe"]: the bytes held at each edge of the model's and every decoder layer's
    forward and backward, with the most held since the edge before ("events"), and the
    bytes autograd saves for backward in each forward of the model, per module, one count
    per storage, parameters (FSDP2's gathered ones too) left out ("saved"). Each edge
    restarts the allocator's peak, so the call's peak in record["update"] (`bracket`'s) is
    made the largest of the edges' again."""
    inner, calls = ppo_module.ppo_update, []

    def wrapped(runtime, run, *args, **kwargs):
        calls.append(None)
        if len(calls) != 2:
            return inner(runtime, run, *args, **kwargs)
        events, saved = [], {}
        try:
            with probe_hooks(run.model, events, saved):
                return inner(runtime, run, *args, **kwargs)
        finally:
            record["probe"] = {"events": events, "saved": {k: sum(v.values()) for k, v in saved.items()}}  # fmt: skip
            start, last = record["update"][-1]
            record["update"][-1] = (start, max([last] + [peak for _, _, peak in events]))

    ppo_module.ppo_update = wrapped


@contextmanager
def probe_hooks(model, events: list, saved: dict):
    """Forward hooks on the causal LM and its decoder layers (gradient hooks on their
    input and output for the backward edges) and a saved-tensors hook, for `probe_update`."""
    top = next(m for m in model.modules() if type(m).__name__.endswith("ForCausalLM"))
    layers = [m for m in model.modules() if "DecoderLayer" in type(m).__name__]
    names = {m: "layer " + n.rsplit(".", 1)[-1] for n, m in model.named_modules()} | {top: "model"}  # fmt: skip
    where, count = ["outside"], [0]  # the module whose forward runs; the model's forwards

    def edge(tag: str) -> None:
        events.append((f"forward {count[0]}: {tag}", cpu_held(), cpu_peak()))
        cpu_reset_peak()

    def pre(module, args, kwargs):
        name = names[module]
        count[0] += name == "model"
        where.append(name)
        edge(f"{name} forward >")
        x = next((a for a in (*args, *kwargs.values()) if torch.is_tensor(a) and a.requires_grad), None)  # fmt: skip
        if x is not None:
            x.register_hook(lambda g: edge(f"{name} backward <"))

    def post(module, args, kwargs, out):
        name = where.pop()
        edge(f"{name} forward <")
        y = out if torch.is_tensor(out) else out[0] if isinstance(out, tuple) else None
        if y is not None and y.requires_grad:
            y.register_hook(lambda g: edge(f"{name} backward >"))

    def pack(t):
        params = set()
        for p in model.parameters():
            with suppress(RuntimeError):  # a DTensor shard: not a tensor autograd saves
                params.add(p.untyped_storage().data_ptr())
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved.setdefault(f"forward {count[0]}: {where[-1]}", {})[storage.data_ptr()] = storage.nbytes()  # fmt: skip
        return t

    handles = [h for m in [top, *layers] for h in (
        m.register_forward_pre_hook(pre, with_kwargs=True), m.register_forward_hook(post, with_kwargs=True)
    )]  # fmt: skip
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
    finally:
        for h in handles:
            h.remove()


def print_probe(probe: dict) -> None:
    """Rank 0's --probe record: the edges (MiB held, the most since the edge before) and
    the saved bytes per forward and module."""
    for tag, held, peak in probe["events"]:
        print(f"    {tag:<36} held {held / 2**20:7.2f}  peak since the edge before {peak / 2**20:7.2f}")  # fmt: skip
    for key, nbytes in probe["saved"].items():
        print(f"    saved for backward in {key:<28} {nbytes / 2**20:7.3f} MiB")


def cell_main(args) -> None:
    """One launched rank: count allocations through a whole GRPO run; write this rank's
    plan and each phase's (held at start, peak) in the second iteration."""
    cpu_install()  # before any model or engine tensor exists

    from rlhf_dist import api
    from rlhf_dist.models import loading
    from rlhf_dist.rollout import collect
    from rlhf_dist.trainers.ppo import recipe as ppo
    from rlhf_dist.trainers.ppo import stats as ppo_stats

    # On CPU transformers maps a checkpoint's weights from its safetensors file (page
    # cache, not torch's allocator): the frozen reference would go uncounted. Copied into
    # allocator memory here, as a GPU run copies them into device memory.
    load = loading._from_pretrained

    def copied(*args, **kwargs):
        model = load(*args, **kwargs)
        if hasattr(model, "parameters"):
            for t in [*model.parameters(), *model.buffers()]:
                t.data = t.data.clone()
        return model

    loading._from_pretrained = copied
    record: dict = {}
    bracket(collect, "_single_turn", "generation", record)
    bracket(collect, "_scoring_forwards", "scoring", record)
    bracket(ppo, "ppo_update", "update", record)
    if args.probe:
        probe_update(ppo, record)
    planned = {}
    stats = ppo_stats.memory_plan_stats

    def keep_plan(runtime, plan, measured):  # the run's own plan, as its metrics log it
        planned.update(plan)
        return stats(runtime, plan, measured)

    ppo_stats.memory_plan_stats = keep_plan
    api.grpo(reward_fn=zero3_reward, overrides=json.loads(args.cell))
    api.close()
    probe = record.pop("probe", None)
    second = {phase: calls[1] for phase, calls in record.items()}
    rank = int(os.environ.get("RANK", "0"))
    result = {"planned": planned, "measured": second, "probe": probe}
    Path(f"{args.result}.{rank}").write_text(json.dumps(result))


# ------------------------------------------------------------------------------ the grid
def run_cell(cell: list[str], result: Path, engine: str = "zero3", probe: bool = False) -> list[dict]:  # fmt: skip
    """Launch one cell on 2 CPU ranks under `engine` (zero3, fsdp2: its cpu_ accelerate
    config); each rank's {"planned", "measured", "probe"}."""
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(REPO / f"accelerate_configs/cpu_{engine}.yaml"),
        __file__, "plan-zero3", "--cell", json.dumps(cell), "--result", str(result),
    ] + (["--probe"] if probe else [])  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"cell failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return [json.loads(Path(f"{result}.{r}").read_text()) for r in (0, 1)]


def zero3_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(
        description="`rlhf-dist plan` against measured per-rank peaks under ZeRO-3 on 2 CPU ranks (issue 35)."
    )
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument(
        "--variants", nargs="+", default=list(ZERO3_VARIANTS), choices=list(ZERO3_VARIANTS)
    )
    ap.add_argument("--out", type=Path, help="write the rows as JSON here too")
    ap.add_argument(
        "--engine", default="zero3", choices=("zero3", "fsdp2"),
        help="the launch config: cpu_zero3.yaml or cpu_fsdp2.yaml (the variants' gather "
        "for training is ZeRO-3's only)",
    )  # fmt: skip
    ap.add_argument(
        "--probe", action="store_true",
        help="also print where the update's peak lies: bytes held at each layer's forward "
        "and backward, and what autograd saves per forward (rank 0)",
    )  # fmt: skip
    ap.add_argument("--cell", help=argparse.SUPPRESS)  # inside a launched rank
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.cell:
        return cell_main(args)
    rows, worst = [], 0.0
    print(f"{'cell':<30} {'phase':<11} {'plan MiB':>9} {'rank 0 / rank 1 MiB':>20} {'ratio':>6}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for size in args.sizes:
            for prompt, response in LENGTHS:
                path, prompts = build_assets(size, prompt, tmp)
                for variant in args.variants:
                    start = time.perf_counter()
                    cell = zero3_overrides(path, prompts, prompt, response, tmp / "run") + ZERO3_VARIANTS[variant]  # fmt: skip
                    ranks = run_cell(cell, tmp / "result", args.engine, args.probe)
                    name = f"{size} P{prompt}+T{response} {variant}"
                    name += " (FSDP2)" if args.engine == "fsdp2" else ""
                    for phase in PHASES:
                        plan = ranks[0]["planned"][phase]
                        got = [r["measured"][phase][1] for r in ranks]
                        ratio = plan / max(got)
                        worst = max(worst, abs(ratio - 1))
                        rows.append({"cell": name, "phase": phase, "plan": plan,
                                     "measured": got, "ratio": ratio})  # fmt: skip
                        print(f"{name:<30} {phase:<11} {plan / 2**20:>9.1f} "
                              f"{got[0] / 2**20:>9.1f} / {got[1] / 2**20:>8.1f} {ratio:>6.2f}")  # fmt: skip
                    if args.probe:
                        print_probe(ranks[0]["probe"])
                    held = " ".join(f"{p} {ranks[0]['measured'][p][0] / 2**20:.1f}" for p in PHASES)
                    print(f"{'':<30} rank 0 held at the start: {held} MiB ({time.perf_counter() - start:.1f} s)", flush=True)  # fmt: skip
    print(f"worst |plan / measured - 1| = {worst:.1%} over {len(rows)} cells x phases (measured: the larger rank)")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


# ==============================================================================================
# counting CPU allocator (used by plan-zero3 and sp)
# Peak tensor memory of a CPU process, across all its threads (benchmarks only).
#
# torch has no CPU counterpart of `torch.cuda.max_memory_allocated`. The profiler's
# allocation records (`profile_memory=True`) see only the threads the profiler runs in:
# under gloo, a collective's buffers are often freed by gloo's worker threads, so those
# frees are missing and the records' running sum grows without bound (measured: +50 MiB per
# rollout of a 5 MiB model under ZeRO-3's per-layer fetches, while the live tensors did not
# grow). This module wraps torch's CPU allocator in one that counts the bytes it hands out
# and takes back, from any thread: `cpu_install()` once, before the tensors to be counted exist;
# then `cpu_held()`, `cpu_peak()` and `cpu_reset_peak()` as torch.cuda's allocator counters.
#
# The wrapper is a small C++ extension built on first use with torch.utils.cpp_extension
# (g++ and ninja; ~1-2 minutes on 2 cores, then cached under ~/.cache/torch_extensions).


_SOURCE = r"""
#include <torch/extension.h>
#include <c10/core/CPUAllocator.h>
#include <atomic>

namespace {
std::atomic<int64_t> held{0};
std::atomic<int64_t> peak{0};

// The wrapped allocation, freed through its own deleter when the context is deleted.
struct Counted {
  c10::DataPtr inner;
  size_t nbytes;
};

void release(void* context) {
  auto* counted = static_cast<Counted*>(context);
  held -= static_cast<int64_t>(counted->nbytes);
  delete counted;
}

struct CountingAllocator final : c10::Allocator {
  explicit CountingAllocator(c10::Allocator* base) : base(base) {}
  c10::DataPtr allocate(size_t nbytes) override {
    c10::DataPtr inner = base->allocate(nbytes);
    void* data = inner.get();
    int64_t now = held += static_cast<int64_t>(nbytes);
    int64_t seen = peak.load();
    while (now > seen && !peak.compare_exchange_weak(seen, now)) {
    }
    return {data, new Counted{std::move(inner), nbytes}, &release, c10::Device(c10::kCPU)};
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
  c10::Allocator* base;
};
}  // namespace

void install() {
  static CountingAllocator counting(c10::GetCPUAllocator());
  c10::SetCPUAllocator(&counting, /*priority=*/100);
}
int64_t held_bytes() { return held.load(); }
int64_t peak_bytes() { return peak.load(); }
void reset_peak() { peak.store(held.load()); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("install", &install);
  m.def("held_bytes", &held_bytes);
  m.def("peak_bytes", &peak_bytes);
  m.def("reset_peak", &reset_peak);
}
"""


_module = None


def cpu_install() -> None:
    """Count every CPU tensor allocation from now on (idempotent)."""
    global _module
    if _module is None:
        import os
        import sys

        from torch.utils.cpp_extension import load_inline

        # ninja comes with the venv (pip's ninja): its bin/ on PATH for the build
        bin_dir = os.path.dirname(sys.executable)
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")

        _module = load_inline("rlhf_dist_cpu_memory", cpp_sources=[_SOURCE], extra_cflags=["-O2"])  # fmt: skip
        _module.install()


def cpu_held() -> int:
    """Bytes of the counted allocations alive now."""
    return _module.held_bytes()


def cpu_peak() -> int:
    """The most bytes held at once since install() or the last reset_peak()."""
    return _module.peak_bytes()


def cpu_reset_peak() -> None:
    """Start a new peak from what is held now."""
    _module.reset_peak()


# ==============================================================================================
# vocab: memory with a real vocabulary
# Peak memory of one critic-free PPO iteration with a real vocabulary (issue #23).
#
# A narrow random Llama (hidden 64, 2 layers) with Qwen's 151,936-token vocabulary runs one
# GRPO iteration through the real trainer (`rlhf-dist ppo` in a subprocess): 2 prompts x 4
# samples = 8 responses of exactly 512 tokens (min_new_tokens = max_new_tokens), k3 KL in
# the loss, one optimizer step per rollout, a Python reward function. The model has ~10M
# parameters, so the peak is about the (B, T, V) logits: a whole fp32 copy of them is
# 8 x 512 x 151,936 x 4 bytes = 2.3 GiB.
#
#     python launch/bench/memory.py vocab OUT [--vocab 151936] [--tokens 512] [KEY=VALUE ...]
#
# Prints the subprocess's peak RSS (getrusage of the child: the whole run, model load
# included) and the phase times the run logged. Extra KEY=VALUE pairs are passed on as
# config overrides (e.g. perf.logprob_chunk_tokens=256). Run it with PYTHONPATH set to the
# tree to measure (the "before" figures of docs/benchmarks.md come from main's tree).
# Times on the shared 2-core CPU are noisy; memory is the figure this measures.


VOCAB_PHASES = ("time/generate", "time/score", "time/update", "time/total", "memory/peak_gib")


def build_policy(out: Path, vocab: int, tokens: int) -> Path:
    """A random narrow Llama with `vocab` output rows and the demo tokenizer (ids past the
    tokenizer's own are sampled but decode to nothing)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from rlhf_dist.demo.task import write_task

    files = write_task(
        out / "task", n_sft=1, n_pref=1, n_pref_eval=1, n_prompts=64, n_eval_prompts=1
    )
    tok = AutoTokenizer.from_pretrained(str(files.tokenizer_dir))
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=256, max_position_embeddings=tokens + 128,
        tie_word_embeddings=False, attention_dropout=0.0, pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    path = out / "policy"
    LlamaForCausalLM(config).save_pretrained(str(path), safe_serialization=True)
    tok.save_pretrained(str(path))
    return files.prompts


def vocab_run_config(out: Path, prompts: Path, tokens: int) -> dict:
    return {
        "run": {"output_dir": str(out / "run"), "histogram_every": 0, "samples_every": 0,
                "progress": False},
        "model": {"policy": str(out / "policy"), "attn_implementation": "eager"},
        "data": {"train": str(prompts)},
        "generation": {"max_new_tokens": tokens, "min_new_tokens": tokens, "temperature": 1.0},
        "reward": {"function": "rlhf_dist.demo.task:positive_word_reward"},
        "ppo": {"iterations": 1, "estimator": "grpo", "rollout_batch_size": 2,
                "samples_per_prompt": 4, "rollout_micro_batch_size": 8, "ppo_epochs": 1,
                "minibatch_size": 8, "micro_batch_size": 8, "kl_placement": "loss",
                "kl_kind": "k3", "kl_coef": 0.04},
    }  # fmt: skip


def vocab_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(
        description="Peak memory of one critic-free PPO iteration with a real vocabulary (issue #23)."
    )
    ap.add_argument("out", type=Path)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = build_policy(args.out, args.vocab, args.tokens)
    cfg_path = args.out / "ppo.yaml"
    cfg_path.write_text(yaml.safe_dump(vocab_run_config(args.out, prompts, args.tokens)))
    cmd = [sys.executable, "-m", "rlhf_dist", "ppo", "--config", str(cfg_path), *args.overrides]
    child = subprocess.Popen(cmd, env=os.environ.copy())
    _, status, usage = os.wait4(child.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"the run failed (exit {os.waitstatus_to_exitcode(status)})")
    rows = [json.loads(line) for line in (args.out / "run/metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    print(f"vocab {args.vocab}, 8 responses x {args.tokens} tokens, overrides {args.overrides}")
    print(f"peak RSS of the run: {usage.ru_maxrss / 2**20:.2f} GiB")  # ru_maxrss is in KiB
    for key in VOCAB_PHASES:
        print(f"{key}: {last.get(key, float('nan')):.2f}")


# ==============================================================================================
# sp: sequence parallelism, per-rank memory
# Per-rank peak memory of one SFT step with distributed.sequence_parallel_size 1 and 2, on
# 2 CPU ranks (issue 35 item 1).
#
#     accelerate launch --config_file accelerate_configs/cpu_ddp.yaml         launch/bench/memory.py sp [--length 4096] [--hidden 256] [--layers 4]
#
# Every rank builds the same random Llama (8 heads, 4 key/value heads) and takes one
# sequence of --length tokens (the whole global batch: 2 sequences, one per rank), then
# runs `trainers.sft.sft_step` (micro-batches of one sequence) twice unmeasured (so that the
# gradients, DDP's buckets and lazily made buffers exist) and once measured. With sp=2 the
# two ranks pool their two sequences and run each split in halves. Measured by counting
# torch's CPU allocations from every thread (the counting allocator below; the profiler's records miss the
# frees gloo's threads make): the peak during the step over what was held when it began,
# i.e. the step's activations and transients (the weights, gradients and Adam moments were
# allocated before). A fourth
# step counts the activations themselves: the bytes autograd saves for one micro-batch's
# backward (saved-tensor hooks, unique storages, weights left out), which excludes the
# fixed-size transients the peak also holds (the log-prob head's (2, 512, V) workspace).
# Prints each
# rank's peak for sp=1 and sp=2 and their ratio, and the planner's update phase activations
# for the same shapes (`rlhf_dist.planning`).


VOCAB = 4096


def llama(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    seed_everything(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=8, num_key_value_heads=4, intermediate_size=args.hidden * 11 // 4,
        max_position_embeddings=args.length + 8, attention_dropout=0.0, pad_token_id=0,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def saved_activations(runtime: Runtime, step) -> int:
    """The most bytes any one micro-batch of `step()` saves for its backward (autograd's
    saved tensors, unique storages, the weights left out): the activations alive when its
    backward starts, which is where the step peaks."""
    per_micro: list[dict[int, int]] = [{}]
    weights: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if isinstance(t, torch.nn.Parameter):
            weights.add(storage.data_ptr())
        per_micro[-1].setdefault(storage.data_ptr(), storage.nbytes())
        return t

    backward = runtime.micro_backward

    def counted(*args, **kwargs):
        done = backward(*args, **kwargs)
        per_micro.append({})
        return done

    runtime.micro_backward = counted  # type: ignore[method-assign]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            step()
    finally:
        del runtime.micro_backward  # the class's method again
    return max(sum(n for p, n in m.items() if p not in weights) for m in per_micro)


def step_peak(runtime: Runtime, args) -> tuple[int, int]:
    """This rank's (peak bytes over held, saved activations) of one measured SFT step
    (after two unmeasured ones)."""
    net = llama(args)
    optimizer = make_optimizer([(net.parameters(), OptimConfig())])
    model, _ = runtime.prepare(net, optimizer, 1, 1, 1.0, "float32")
    model.train()
    g = torch.Generator().manual_seed(1)
    examples = [
        SFTExample(torch.randint(2, VOCAB, (args.length,), generator=g).tolist(), 64)
        for _ in range(runtime.world_size)
    ]
    plan = BatchPlan(runtime.world_size, runtime.world_size, 1)
    perf = PerfConfig()

    def step():
        sft_step(runtime, model, examples, plan, 0, perf)

    # Two unmeasured steps: the first measured step after only one still counted lazily
    # made allocations (0.60 vs 0.72 of sp=1 on rank 0, the same run repeated).
    for _ in range(2):
        step()
    optimizer.zero_grad(set_to_none=False)  # the gradients stay allocated: not measured
    runtime.barrier()
    cpu_reset_peak()
    start = cpu_held()
    step()
    peak = cpu_peak() - start
    runtime.barrier()
    optimizer.zero_grad(set_to_none=False)
    saved = saved_activations(runtime, step)
    runtime.barrier()
    return peak, saved


def sp_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        description="Per-rank memory of an SFT step with sequence parallelism."
    )
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args(argv)
    cpu_install()
    quiet_transformers()
    peaks = {}
    for n in (1, 2):
        runtime = Runtime(seed=0, num_threads=1, sequence_parallel_size=n)
        peaks[n] = runtime.gather_objects([step_peak(runtime, args)])
    if runtime.is_main:
        mib = 2**20
        print(f"SFT step, {args.length}-token sequences, hidden {args.hidden}, "
              f"{args.layers} layers, 8 heads / 4 KV heads, vocab {VOCAB}, fp32, 2 ranks")  # fmt: skip
        for r in range(runtime.world_size):
            (one, one_saved), (two, two_saved) = peaks[1][r], peaks[2][r]
            print(f"rank {r}: peak over held  sp=1 {one / mib:8.1f} MiB  sp=2 {two / mib:8.1f} MiB"
                  f"  ratio {two / one:.3f}")  # fmt: skip
            print(f"        activations saved sp=1 {one_saved / mib:8.1f} MiB  sp=2 {two_saved / mib:8.1f} MiB"
                  f"  ratio {two_saved / one_saved:.3f}")  # fmt: skip


# ==============================================================================================
# sync: weight sync memory under ZeRO-3
# Memory of the weight sync to a rollout server under ZeRO-3 (docs/serving.md, "Weight
# sync memory"): the arithmetic demo's GRPO work (quick size, the real SmolLM2-135M in fp32,
# 513 MiB of weights) on 2 CPU ranks under ZeRO-3 (accelerate_configs/cpu_zero3.yaml, gloo),
# its rollouts from one `rlhf-dist serve` process, with each bucket size of
# generation.server_sync_bucket_mb. Prints, per bucket size, the largest bucket in MiB and
# `memory/sync_peak_mib` (how far the sync raised a rank's resident memory; the largest
# over ranks and iterations) and the sync's seconds: under ZeRO-3 each bucket is gathered
# on its own, so the growth should follow the bucket, not the model.
#
# Usage: python launch/bench/memory.py sync [--buckets 16 64 1024] [--iterations 2]
#        [--out runs/bench/sync_memory]


def largest_bucket_mib(policy: Path, bucket_mb: float) -> float:
    """The largest bucket the walk makes of the policy's weights, in MiB (fp32)."""
    from safetensors import safe_open

    with safe_open(str(policy / "model.safetensors"), "pt") as f:
        named = [(k, f.get_slice(k)) for k in f.keys()]  # noqa: SIM118 (safe_open has no __iter__)
        sizes = [(k, _numel(s.get_shape())) for k, s in named]

    class Sized:  # weight_buckets reads numel() and element_size()
        def __init__(self, n):
            self.n = n

        def numel(self):
            return self.n

        def element_size(self):
            return 4

    buckets = weight_buckets(((k, Sized(n)) for k, n in sizes), int(bucket_mb * 2**20))
    return max(sum(p.n for _, p in b) for b in buckets) * 4 / 2**20


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def sync_run(policy: Path, url: str, bucket_mb: float, out: Path, iterations: int) -> list[dict]:
    tree = arithmetic_demo.arithmetic_stage_configs(out, policy, seed=0, quick=True)["grpo"]
    tree["sync_run"] |= {"output_dir": str(out / f"bucket{bucket_mb:g}"), "progress": False}
    tree["generation"] |= {"backend": "server", "server_urls": [url],
                           "server_token_env": TOKEN_ENV, "server_sync_bucket_mb": bucket_mb}  # fmt: skip
    tree["ppo"] |= {"iterations": iterations, "micro_batch_size": 8}  # 2 ranks x 8 = a minibatch
    tree["perf"] = {"num_threads": 1}
    config = out / f"bucket{bucket_mb:g}.json"
    config.write_text(json.dumps(tree))
    cmd = [sys.executable, "-m", "accelerate.commands.launch",
           "--config_file", str(REPO / "accelerate_configs" / "cpu_zero3.yaml"),
           "--main_process_port", str(free_port()),
           "-m", "rlhf_dist", "ppo", "--config", str(config)]  # fmt: skip
    subprocess.sync_run(cmd, env=os.environ | {"OMP_NUM_THREADS": "1"}, check=True)
    lines = (out / f"bucket{bucket_mb:g}" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "memory/sync_peak_mib" in r]


def sync_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        description='Memory of the weight sync to a rollout server under ZeRO-3 (docs/serving.md, "Weight'
    )
    parser.add_argument("--buckets", type=float, nargs="+", default=[16, 64, 1024])
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--out", default="runs/bench/sync_memory")
    args = parser.parse_args(argv)
    os.environ.setdefault(TOKEN_ENV, os.urandom(16).hex())
    policy, out = smollm2.build("shipped"), Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        server = start_server(policy, port, 1, Path(tmp))
        try:
            for mb in args.buckets:
                rows = sync_run(policy, f"http://127.0.0.1:{port}", mb, out, args.iterations)
                results.append((mb, largest_bucket_mib(policy, mb), rows))
        finally:
            server.terminate()
            server.wait(timeout=60)
    print("GRPO on SmolLM2-135M (513 MiB fp32), 2 CPU ranks under ZeRO-3 + one server; "
          "per bucket size: the largest bucket, the sync's memory growth (max over ranks, "
          "per iteration) and seconds")  # fmt: skip
    print(f"{'bucket MiB':>10} {'largest':>8} {'growth MiB':>24} {'sync s':>14}")
    for mb, largest, rows in results:
        growth = ", ".join(f"{r['memory/sync_peak_mib']:.0f}" for r in rows)
        seconds = ", ".join(f"{r['time/weight_sync']:.1f}" for r in rows)
        print(f"{mb:>10g} {largest:8.0f} {growth:>24} {seconds:>14}")


CHECKS = {"plan": plan_main, "plan-zero3": zero3_main, "vocab": vocab_main, "sp": sp_main,
          "sync": sync_main}  # fmt: skip
RANKS = ("plan-zero3", "sp", "sync")  # leave without interpreter teardown (api.end_process)


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in CHECKS:
        raise SystemExit(f"usage: memory.py CHECK [ARGS...] (CHECK: {', '.join(CHECKS)})")
    sys.argv[0] = " ".join(sys.argv[:2])  # each step's --help names it
    CHECKS[sys.argv[1]](sys.argv[2:])
    if sys.argv[1] in RANKS:
        sys.exit(end_process())


if __name__ == "__main__":
    main()
