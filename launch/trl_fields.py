"""Write the field names of TRL's trainer configs to tests/data/trl_1_16_fields.json.

Usage: python launch/trl_fields.py TRL_DIR [--older TRL_DIR ...] [--transformers FILE]
                                   [-o tests/data/trl_1_16_fields.json]

TRL_DIR is an unpacked TRL wheel (the folder holding `trl/` and `trl-X.dist-info/`):

    pip download --no-deps trl==1.16.0 -d /tmp/trl
    python -m zipfile -e /tmp/trl/trl-1.16.0-py3-none-any.whl /tmp/trl/unpacked
    python launch/trl_fields.py /tmp/trl/unpacked

The sources are read with `ast`, never imported (TRL would pull in its dependencies). A
config's fields are the annotated class attributes of its class and of its TRL base
classes (followed through the imports of each file), up to transformers'
`TrainingArguments`. The fields of `TrainingArguments` itself (read from FILE, by default
the installed transformers' training_args.py, located without importing it) are
inherited, not TRL's: they are left out of each config's list, and the ones users set
most (`INHERITED` below) are written under "TrainingArguments".

A config the newest TRL no longer ships (PPOConfig left TRL in 1.13) is read from the
first `--older` wheel that has it; the header records which version each list comes
from. docs/from_trl.md maps every listed field; tests/unit/test_unit_from_trl.py holds
the two together, so regenerating this file for a newer TRL shows what changed.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import importlib.util
import json
import re
import sys
from pathlib import Path

# Each config and where TRL keeps it (the first path that exists is read).
CONFIGS = {
    "GRPOConfig": ["trl/trainer/grpo_config.py"],
    "DPOConfig": ["trl/trainer/dpo_config.py"],
    "KTOConfig": ["trl/trainer/kto_config.py"],
    "RewardConfig": ["trl/trainer/reward_config.py"],
    "SFTConfig": ["trl/trainer/sft_config.py"],
    "PPOConfig": ["trl/experimental/ppo/ppo_config.py", "trl/trainer/ppo_config.py"],
    "CPOConfig": ["trl/experimental/cpo/cpo_config.py", "trl/trainer/cpo_config.py"],
    "ORPOConfig": ["trl/experimental/orpo/orpo_config.py", "trl/trainer/orpo_config.py"],
    "OnlineDPOConfig": [
        "trl/experimental/online_dpo/online_dpo_config.py",
        "trl/trainer/online_dpo_config.py",
    ],
}

# The inherited TrainingArguments fields docs/from_trl.md maps (the ones users set).
INHERITED = [
    "output_dir", "run_name", "project", "seed", "learning_rate", "lr_scheduler_type",
    "lr_scheduler_kwargs", "warmup_steps", "weight_decay", "adam_beta1", "adam_beta2",
    "adam_epsilon", "optim", "max_grad_norm", "per_device_train_batch_size",
    "per_device_eval_batch_size", "gradient_accumulation_steps", "num_train_epochs",
    "max_steps", "bf16", "fp16", "gradient_checkpointing", "use_liger_kernel",
    "torch_compile", "logging_steps", "report_to", "eval_strategy", "eval_steps",
    "save_strategy", "save_steps", "save_total_limit", "resume_from_checkpoint",
    "push_to_hub", "hub_model_id", "deepspeed", "fsdp", "ddp_timeout", "use_cpu",
    "parallelism_config",
]  # fmt: skip

BASE = "TrainingArguments"


def class_fields(tree: ast.Module, name: str) -> tuple[list[str], list[ast.expr]] | None:
    """(annotated attribute names, base expressions) of class `name` in `tree`, or None."""
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            names = [
                s.target.id
                for s in node.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            ]
            return names, node.bases
    return None


def imported_from(tree: ast.Module, path: Path, root: Path, name: str) -> tuple[Path, str] | None:
    """The file and original name that `from X import name` in `tree` (at `path`) points
    to inside `root`; None when it comes from outside (transformers) or is not imported."""
    for node in tree.body:
        if not isinstance(node, ast.ImportFrom):
            continue
        for alias in node.names:
            if (alias.asname or alias.name) != name:
                continue
            if node.level:
                base = path.parent
                for _ in range(node.level - 1):
                    base = base.parent
            elif node.module and node.module.split(".")[0] == "trl":
                base = root
            else:
                return None
            parts = (node.module or "").split(".") if node.module else []
            target = base.joinpath(*parts)
            for candidate in (target.with_suffix(".py"), target / "__init__.py"):
                if candidate.is_file():
                    return candidate, alias.name
            return None
    return None


def config_fields(root: Path, path: Path, name: str) -> set[str]:
    """Every annotated field of class `name` in `path` and its TRL bases."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = class_fields(tree, name)
    if found is None:
        raise SystemExit(f"trl_fields: no class {name} in {path}")
    names, bases = found
    fields = set(names)
    for base in bases:
        base_name = ast.unparse(base).split(".")[-1]
        if base_name == BASE:
            continue
        if class_fields(tree, base_name) is not None:
            fields |= config_fields(root, path, base_name)
            continue
        source = imported_from(tree, path, root, base_name)
        if source is None:
            raise SystemExit(f"trl_fields: cannot find base {base_name} of {name} ({path})")
        fields |= config_fields(root, *source)
    return fields


def trl_version(root: Path) -> str:
    """The Version: line of the unpacked wheel's METADATA."""
    for meta in sorted(root.glob("trl-*.dist-info/METADATA")):
        match = re.search(r"^Version: (\S+)$", meta.read_text(encoding="utf-8"), re.M)
        if match:
            return match.group(1)
    raise SystemExit(f"trl_fields: {root} holds no trl-*.dist-info/METADATA (an unpacked wheel?)")


def transformers_fields(path: Path) -> tuple[set[str], str]:
    """(TrainingArguments' fields, transformers' version) from its training_args.py."""
    found = class_fields(ast.parse(path.read_text(encoding="utf-8")), BASE)
    if found is None:
        raise SystemExit(f"trl_fields: no class {BASE} in {path}")
    init = (path.parent / "__init__.py").read_text(encoding="utf-8")
    match = re.search(r'^__version__ = "([^"]+)"', init, re.M)
    return set(found[0]), match.group(1) if match else "unknown"


def default_training_args() -> Path:
    """The installed transformers' training_args.py, found without importing transformers."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("trl_fields: transformers is not installed; pass --transformers FILE")
    return Path(list(spec.submodule_search_locations)[0]) / "training_args.py"


def collect(roots: list[Path], training_args: Path) -> dict:
    """The JSON document: header, one sorted list per config, the mapped inherited fields."""
    inherited, tf_version = transformers_fields(training_args)
    unknown = sorted(set(INHERITED) - inherited)
    if unknown:
        raise SystemExit(f"trl_fields: not fields of {BASE} {tf_version}: {unknown}")
    sources, lists = {}, {}
    for name, candidates in CONFIGS.items():
        hit = next(((r, r / c) for r in roots for c in candidates if (r / c).is_file()), None)
        if hit is None:
            raise SystemExit(f"trl_fields: no wheel given holds {name} ({candidates})")
        root, path = hit
        sources[name] = f"trl {trl_version(root)}: {path.relative_to(root)}"
        lists[name] = sorted(config_fields(root, path, name) - inherited)
    header = {
        "trl_version": trl_version(roots[0]),
        "transformers_version": tf_version,
        "generated": datetime.date.today().isoformat(),
        "how": "python launch/trl_fields.py <unpacked trl wheel> [--older <wheel>]: dataclass "
        f"fields read with ast; a config's list leaves out the fields of {BASE}",
        "sources": sources,
    }
    return {"_header": header, **lists, BASE: sorted(INHERITED)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trl_dir", type=Path, help="unpacked TRL wheel (the newest)")
    ap.add_argument("--older", type=Path, action="append", default=[],
                    help="unpacked older TRL wheel for configs the newest no longer has")  # fmt: skip
    ap.add_argument("--transformers", type=Path, help="transformers' training_args.py")
    ap.add_argument("-o", "--output", type=Path, default=Path("tests/data/trl_1_16_fields.json"))
    args = ap.parse_args(argv)
    doc = collect([args.trl_dir, *args.older], args.transformers or default_training_args())
    args.output.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.output.with_name(args.output.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    tmp.replace(args.output)  # no half-written file
    counts = ", ".join(f"{k} {len(v)}" for k, v in doc.items() if k != "_header")
    print(f"wrote {args.output}: {counts}", file=sys.stderr)


if __name__ == "__main__":
    main()
