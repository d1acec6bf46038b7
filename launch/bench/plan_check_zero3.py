"""`rlhf-dist plan` against measured per-rank peaks under ZeRO-3 on 2 CPU ranks (issue 35).

plan_check.py's grid runs the phases in one process, where ZeRO-3 partitions over one
rank. Here each cell is a real GRPO run (`rlhf_dist.api.grpo`, 2 iterations) launched
with `accelerate launch --config_file accelerate_configs/cpu_zero3.yaml` (2 processes,
DeepSpeed ZeRO-3 over gloo), on plan_check.py's random Llamas (sizes S, M, L) and
sequence lengths, with a word-level tokenizer of the model's whole vocabulary and prompts
of exactly P tokens. Each rank samples 8 sequences (1 prompt x 8) of exactly T tokens
(min_new_tokens = max_new_tokens) and updates in 2 micro-batches of 4, fp32.

Variants: `zero3` (the defaults: on CPU the whole actor is gathered once for the rollout
and once per optimizer step, perf.gather_for_*), `zero3-layers` (both gathers off:
ZeRO-3's per-layer fetches in every forward and backward), `zero3-lora` (LoRA adapters),
`zero3-kl` (a KL penalty: the frozen reference scores every rollout, placed as
distributed.frozen_models=auto decides).

Measured, per rank, as plan_check.py measures: torch's CPU allocator's allocation and free
records (`profile_memory=True`), here from before the model exists, so their running sum
is the bytes held; each phase's peak is that sum's maximum between the phase's markers in
the second iteration (the first creates Adam's moments). Phases: generation (sampling,
inside the rollout's whole-weights span), scoring (the scoring forwards) and the update
(`ppo_update`). The plan is the run's own (planned_phases with the run's Hardware: 2 ranks,
ZeRO-3, the host's memory shared by the ranks), computed in the run as its metrics do.

    PYTHONPATH=. python launch/bench/plan_check_zero3.py [--sizes S M L] [--variants ...] [--out rows.json]
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
from pathlib import Path

from rlhf_dist.api import end_process

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpu_memory  # noqa: E402
from plan_check import LENGTHS, PHASES, SIZES  # noqa: E402

VARIANTS = {
    "zero3": [],
    "zero3-layers": ["perf.gather_for_generation=false", "perf.gather_for_training=never"],
    "zero3-lora": ["lora.enabled=true"],
    "zero3-kl": ["ppo.kl_coef=0.05"],
}
SAMPLES = 8  # sequences per rank: 1 prompt x 8 samples, as plan_check.py's ROWS


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


def overrides(path: Path, prompts: Path, prompt: int, response: int, out: Path) -> list[str]:
    return [
        f"model.policy={path}", f"data.train={prompts}", f"data.max_prompt_length={prompt}",
        f"generation.max_new_tokens={response}", f"generation.min_new_tokens={response}",
        "ppo.kl_coef=0", "ppo.iterations=2", "ppo.rollout_batch_size=2",
        f"ppo.samples_per_prompt={SAMPLES}", f"ppo.rollout_micro_batch_size={SAMPLES}",
        "ppo.micro_batch_size=4", "model.dtype=float32", "model.attn_implementation=sdpa",
        "perf.packed_linears=false", f"run.output_dir={out}",
    ]  # fmt: skip


def reward(prompts, responses):
    """Varied scores so the groups are not tied: the share of even-numbered words."""
    return [sum(int(w[1:]) % 2 == 0 for w in r.split()) / max(1, len(r.split())) for r in responses]  # fmt: skip


# ------------------------------------------------------------------ inside one launched rank
def bracket(module, attr: str, phase: str, record: dict) -> None:
    """Wrap module.attr: each call appends (bytes held when it began, the peak during it)
    to record[phase]."""
    inner = getattr(module, attr)

    def wrapped(*args, **kwargs):
        cpu_memory.reset_peak()
        start = cpu_memory.held()
        try:
            return inner(*args, **kwargs)
        finally:
            record.setdefault(phase, []).append((start, cpu_memory.peak()))

    setattr(module, attr, wrapped)


def cell_main(args) -> None:
    """One launched rank: count allocations through a whole GRPO run; write this rank's
    plan and each phase's (held at start, peak) in the second iteration."""
    cpu_memory.install()  # before any model or engine tensor exists

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
    planned = {}
    stats = ppo_stats.memory_plan_stats

    def keep_plan(runtime, plan, measured):  # the run's own plan, as its metrics log it
        planned.update(plan)
        return stats(runtime, plan, measured)

    ppo_stats.memory_plan_stats = keep_plan
    api.grpo(reward_fn=reward, overrides=json.loads(args.cell))
    api.close()
    second = {phase: calls[1] for phase, calls in record.items()}
    rank = int(os.environ.get("RANK", "0"))
    Path(f"{args.result}.{rank}").write_text(json.dumps({"planned": planned, "measured": second}))


# ------------------------------------------------------------------------------ the grid
def run_cell(cell: list[str], result: Path) -> list[dict]:
    """Launch one cell on 2 ZeRO-3 CPU ranks; each rank's {"planned", "measured"}."""
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(REPO / "accelerate_configs/cpu_zero3.yaml"),
        __file__, "--cell", json.dumps(cell), "--result", str(result),
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"cell failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return [json.loads(Path(f"{result}.{r}").read_text()) for r in (0, 1)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--out", type=Path, help="write the rows as JSON here too")
    ap.add_argument("--cell", help=argparse.SUPPRESS)  # inside a launched rank
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
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
                    cell = overrides(path, prompts, prompt, response, tmp / "run") + VARIANTS[variant]  # fmt: skip
                    ranks = run_cell(cell, tmp / "result")
                    name = f"{size} P{prompt}+T{response} {variant}"
                    for phase in PHASES:
                        plan = ranks[0]["planned"][phase]
                        got = [r["measured"][phase][1] for r in ranks]
                        ratio = plan / max(got)
                        worst = max(worst, abs(ratio - 1))
                        rows.append({"cell": name, "phase": phase, "plan": plan,
                                     "measured": got, "ratio": ratio})  # fmt: skip
                        print(f"{name:<30} {phase:<11} {plan / 2**20:>9.1f} "
                              f"{got[0] / 2**20:>9.1f} / {got[1] / 2**20:>8.1f} {ratio:>6.2f}")  # fmt: skip
                    held = " ".join(f"{p} {ranks[0]['measured'][p][0] / 2**20:.1f}" for p in PHASES)
                    print(f"{'':<30} rank 0 held at the start: {held} MiB ({time.perf_counter() - start:.1f} s)", flush=True)  # fmt: skip
    print(f"worst |plan / measured - 1| = {worst:.1%} over {len(rows)} cells x phases (measured: the larger rank)")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
    sys.exit(end_process())  # a rank leaves without interpreter teardown (api.end_process)
