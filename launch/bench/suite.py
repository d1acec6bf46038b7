"""The scale suite's inputs and its table (launch/bench/gpu_suite.sh, engines.sh, lora_vs_full.sh).

    python launch/bench/suite.py prepare OUT --shape deep|lora|gpu|tiny [--prompts 256]
    python launch/bench/suite.py config OUT CASE [--device cuda|cpu]   write OUT/CASE.yaml
    python launch/bench/suite.py report RUN_DIR [RUN_DIR ...]          print the table
    python launch/bench/suite.py ratio ROOT CASE BASE                  phase ratios

`prepare` builds a random-init Llama policy and reward model of a chosen shape, with the
demo task's tokenizer and prompts, as Hugging Face checkpoints: OUT/{policy,reward}/ and
OUT/prompts.jsonl. The shapes are the ones the benchmarks are about, not the demo's:
`deep` (hidden 64 x 24 layers, vocab 1000) makes ZeRO-3's per-parameter costs visible on
a CPU; `lora` (hidden 256 x 12 layers) is the LoRA-vs-full comparison; `gpu` (~0.47B:
hidden 1024 x 24 layers, 32k vocab) is the one-GPU suite's model. The model's vocabulary
may be larger than the tokenizer's (token ids beyond it are never fed): what matters here
is the size of the embedding and the output layer.

A case is a `rlhf-dist ppo` run config over the models `prepare` built in OUT:
`plain` (the asked dtype; bf16 on a GPU means fp32 master weights + bf16 autocast),
`lora` (the shipped one-GPU LoRA config, launch/configs/ppo_lora_1gpu.yaml, with the
suite's models, data and iteration count), `gc` (plain with gradient checkpointing).
ZeRO-3 is `plain` launched with a DeepSpeed config. The report reads each run's
metrics.jsonl and drops the first iteration (CUDA context, allocator and kernel warm-up).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import yaml

from rlhf_dist.config import sizes

REPO = Path(__file__).resolve().parents[2]
# Per device: prompts per iteration, response tokens, ppo micro-batch, dtype. The GPU
# numbers are the issue's: 64 prompts x 128 tokens, 4 epochs x 4 minibatches.
SETTINGS = {
    "cuda": {"prompts": 64, "tokens": 128, "micro": 16, "dtype": "bfloat16"},
    "cpu": {"prompts": 16, "tokens": 16, "micro": 4, "dtype": "float32"},
}
PHASES = ("time/total", "time/generate", "time/score", "time/update")


def run_config(out: Path, case: str, device: str, iterations: int) -> dict:
    s = SETTINGS[device]
    base = {}
    if case == "lora":
        base = yaml.safe_load((REPO / "launch/configs/ppo_lora_1gpu.yaml").read_text())
        base["run"]["trackers"] = []
    cfg = _merge(
        base,
        {
            "model": {"policy": str(out / "policy"), "reward": str(out / "reward"),
                      "dtype": s["dtype"], "gradient_checkpointing": case == "gc"},
            "data": {"train": str(out / "prompts.jsonl")},
            "run": {"histogram_every": 0, "samples_every": 0, "progress": False, "log_every": 1},
            "generation": {"max_new_tokens": s["tokens"], "min_new_tokens": s["tokens"]},
            "ppo": {"iterations": iterations, "rollout_batch_size": s["prompts"]},
        },
    )  # fmt: skip
    if case == "lora":  # the shipped layout, cut down to the CPU's smaller rollout
        for k in ("minibatch_size", "rollout_micro_batch_size", "micro_batch_size"):
            cfg["ppo"][k] = min(cfg["ppo"][k], s["prompts"])
    else:  # 4 minibatches per epoch, micro-batches as SETTINGS says
        cfg["ppo"] |= {
            "rollout_micro_batch_size": s["prompts"],
            "minibatch_size": s["prompts"] // 4,
            "micro_batch_size": min(s["micro"], s["prompts"] // 4),
        }
    return cfg


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out.get(k, {}), v) if isinstance(v, dict) else v
    return out


def update_flops(run_dir: Path) -> float:
    """Model FLOPs of one iteration's update: per trained model, tokens x epochs x
    (6 x parameters for full fine-tuning: forward 2, backward 4; 4 x parameters for a
    frozen LoRA base, whose weight gradients are never computed). Recomputation under
    gradient checkpointing is not counted, as MFU conventionally does not. Tokens are
    the response tokens only (prompts are a few tokens here): a lower bound."""
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    lora = cfg.get("lora", {})
    factors = {"policy": 4 if lora.get("enabled") else 6, "reward": 4 if lora.get("critic") else 6}
    p, g = cfg["ppo"], cfg["generation"]
    # ppo.ppo_epochs null resolves by the trainer's own rule (4 with a critic, 1 without).
    epochs = sizes.ppo_epochs(p["ppo_epochs"], p["estimator"])
    tokens = p["rollout_batch_size"] * g["max_new_tokens"] * epochs
    total = 0.0
    for key, factor in factors.items():
        c = json.loads((Path(cfg["model"][key]) / "config.json").read_text())
        h, inter = c["hidden_size"], c["intermediate_size"]
        kv_width = (
            h * c.get("num_key_value_heads", c["num_attention_heads"]) // c["num_attention_heads"]
        )
        params = c["num_hidden_layers"] * (2 * h * h + 2 * h * kv_width + 3 * h * inter)
        if key == "policy":
            params += c["vocab_size"] * h  # the output layer
        total += factor * params * tokens
    return total


def report(run_dirs: list[Path], peak_flops: float | None) -> None:
    head = f"{'run':<14} {'s/iter':>16} {'generate':>9} {'score':>7} {'update':>8} {'peak GiB':>9} {'MFU upd':>8}"
    print(head)
    print("-" * len(head))
    for d in run_dirs:
        rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "time/total" in r][1:] or rows
        med = {k: statistics.median(r[k] for r in rows) for k in PHASES}
        lo, hi = min(r["time/total"] for r in rows), max(r["time/total"] for r in rows)
        peak = max(r.get("memory/peak_gib", 0.0) for r in rows)
        mfu = "-"
        if peak_flops:
            mfu = f"{update_flops(d) / med['time/update'] / peak_flops:.1%}"
        print(
            f"{d.name:<14} {med['time/total']:>6.2f} ({lo:.2f}-{hi:.2f}) {med['time/generate']:>9.2f} "
            f"{med['time/score']:>7.2f} {med['time/update']:>8.2f} {peak:>9.2f} {mfu:>8}"
        )
    print("medians over iterations 2.. (the first one warms up); s/iter range in brackets")


def ratio(root: Path, case: str, base: str) -> None:
    """Per phase: median over `case`'s runs (each its median over iterations 2..) divided by
    the same of `base`'s runs; runs are the directories ROOT/CASE-* and ROOT/BASE-*."""

    def medians(name: str, key: str) -> float:
        per_run = []
        for d in sorted(p for p in root.glob(f"{name}-*") if p.is_dir()):
            rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
            rows = [r for r in rows if "time/total" in r][1:]
            per_run.append(statistics.median(r[key] for r in rows))
        return statistics.median(per_run)

    for key in PHASES:
        print(f"{case} / {base} {key:<14} {medians(case, key) / medians(base, key):.2f}")


SHAPES = {
    # name: (hidden, layers, heads, kv heads, intermediate, vocab)
    "tiny": (64, 2, 4, 2, 256, 1000),
    "deep": (64, 24, 4, 4, 256, 1000),
    "lora": (256, 12, 4, 4, 1024, 1000),
    "gpu": (1024, 24, 16, 16, 4096, 32000),
}


def build(out: Path, shape: str, prompts: int, seed: int = 0) -> None:
    import torch
    from transformers import (
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
        LlamaForSequenceClassification,
    )

    from rlhf_dist.demo.task import write_task

    files = write_task(
        out / "task", n_sft=1, n_pref=1, n_pref_eval=1, n_prompts=prompts, n_eval_prompts=1
    )
    tokenizer = AutoTokenizer.from_pretrained(str(files.tokenizer_dir))
    hidden, layers, heads, kv, inter, vocab = SHAPES[shape]

    def config(**extra) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=max(vocab, len(tokenizer)), hidden_size=hidden, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=inter,
            max_position_embeddings=512, tie_word_embeddings=False, attention_dropout=0.0,
            pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id, **extra,
        )  # fmt: skip

    torch.manual_seed(seed)
    for name, model in (
        ("policy", LlamaForCausalLM(config())),
        ("reward", LlamaForSequenceClassification(config(num_labels=1))),
    ):
        model.save_pretrained(str(out / name), safe_serialization=True)
        tokenizer.save_pretrained(str(out / name))
        n = sum(p.numel() for p in model.parameters())
        print(f"{name}: {n / 1e6:.2f}M parameters ({shape}: hidden {hidden} x {layers} layers)")
    (out / "prompts.jsonl").write_bytes(files.prompts.read_bytes())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="build OUT/{policy,reward}/ and OUT/prompts.jsonl")
    p.add_argument("out", type=Path)
    p.add_argument("--shape", default="deep", choices=sorted(SHAPES))
    p.add_argument("--prompts", type=int, default=256)
    c = sub.add_parser("config")
    c.add_argument("out", type=Path)
    c.add_argument("case", choices=("plain", "lora", "gc"))
    c.add_argument("--device", default="cpu", choices=sorted(SETTINGS))
    c.add_argument("--iterations", type=int, default=5)
    r = sub.add_parser("report")
    r.add_argument("runs", type=Path, nargs="+")
    r.add_argument("--peak-tflops", type=float, default=None, help="for the MFU column")
    q = sub.add_parser("ratio", help="phase ratios of CASE-* runs to BASE-* runs under ROOT")
    q.add_argument("root", type=Path)
    q.add_argument("case")
    q.add_argument("base")
    args = ap.parse_args()
    if args.cmd == "prepare":
        build(args.out, args.shape, args.prompts)
    elif args.cmd == "ratio":
        ratio(args.root, args.case, args.base)
    elif args.cmd == "config":
        cfg = run_config(args.out, args.case, args.device, args.iterations)
        path = args.out / f"{args.case}.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
        print(path)
    else:
        report(args.runs, args.peak_tflops * 1e12 if args.peak_tflops else None)


if __name__ == "__main__":
    sys.exit(main())
