"""The model card (README.md) written beside every exported model (docs/distributed.md,
"Model cards and the Hugging Face Hub").

YAML front matter the Hugging Face Hub reads (library_name, base_model, tags, datasets),
then what was trained from what on what, the few settings that define the run, the
stage's final numbers from summary.json and how to load it. Pure: the trainers gather
the facts (`CardFacts`), this module turns them into text; nothing here reads a file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import yaml

# What each kind of export is, and the class that loads it.
KINDS = {
    "policy": ("The policy (a causal LM)", "AutoModelForCausalLM"),
    "reward": ("A reward model (one score per sequence)", "AutoModelForSequenceClassification"),
    "critic": (
        "The critic (value model) trained beside the actor",
        "AutoModelForSequenceClassification",
    ),
    "adapter": ("The LoRA adapter of the policy", "PeftModel"),
}

ALGORITHMS = {
    "sft": ("supervised fine-tuning (SFT)", "sft"),
    "rm": ("the Bradley-Terry loss on preference pairs", "reward-model"),
    "kto": ("KTO", "kto"),
}
# dpo.loss_type other than sigmoid -> (what the card says, hub tag)
DPO_LOSSES = {
    "ipo": ("IPO", "ipo"),
    "simpo": ("SimPO (reference-free)", "simpo"),
    "orpo": ("ORPO (reference-free)", "orpo"),
}
# ppo.estimator -> (what the card says, hub tag)
ESTIMATORS = {
    "gae": ("PPO with GAE (actor-critic)", "ppo"),
    "grpo": ("GRPO", "grpo"),
    "rloo": ("RLOO", "rloo"),
    "reinforce_pp": ("REINFORCE++", "reinforce-pp"),
    "reinforce_pp_baseline": ("REINFORCE++ with a group baseline", "reinforce-pp"),
    "distill": ("on-policy distillation from a teacher", "distillation"),
    "online_dpo": ("online DPO (pairs of the policy's own samples)", "online-dpo"),
}

# The settings that define a run, per stage (dotted config keys), shown in the card's table;
# empty values (no reward function, ...) are left out. The whole config is config.yaml.
STAGE_KEYS = {
    "sft": ("sft.epochs", "sft.batch_size", "sft.optim.lr", "sft.optim.schedule"),
    "rm": ("rm.epochs", "rm.batch_size", "rm.optim.lr", "rm.optim.schedule"),
    "dpo": (
        "dpo.loss_type",
        "dpo.beta",
        "dpo.label_smoothing",
        "dpo.epochs",
        "dpo.batch_size",
        "dpo.optim.lr",
    ),
    "kto": (
        "kto.beta",
        "kto.desirable_weight",
        "kto.undesirable_weight",
        "kto.epochs",
        "kto.batch_size",
        "kto.optim.lr",
    ),
    "ppo": (
        "ppo.estimator",
        "ppo.policy_loss",
        "ppo.iterations",
        "ppo.rollout_batch_size",
        "ppo.samples_per_prompt",
        "ppo.kl_coef",
        "ppo.kl_placement",
        "ppo.optim.lr",
        "generation.max_new_tokens",
        "generation.temperature",
        "reward.function",
        "reward.functions",
        "reward.url",
        "reward.judge",
        "model.reward",
        "model.teacher",
    ),
}
COMMON_KEYS = ("data.max_length", "model.dtype", "lora.enabled", "run.seed")
LORA_KEYS = ("lora.r", "lora.alpha", "lora.export")


@dataclass(frozen=True)
class CardFacts:
    """What one card says. config: the effective config as a tree (`config.to_dict`);
    base_model: the starting model (path or hub name), base_on_hub: it names a hub model
    (a local path is not valid hub metadata, so it stays in the text only); hub_datasets:
    data.train / data.eval values that name hub datasets; metrics: the stage's summary;
    load_from / subfolder: where a user loads the model from (a hub repo or a directory)."""

    stage: str  # sft, rm, ppo, dpo, kto
    kind: str  # a KINDS key
    config: dict
    base_model: str
    base_on_hub: bool
    hub_datasets: tuple[str, ...]
    metrics: dict
    date: str  # ISO date of the export
    load_from: str
    subfolder: str = ""


def lookup(tree: dict, dotted: str) -> Any:
    """The value of a dotted key in a config tree (KeyError if it is not there)."""
    value = tree
    for part in dotted.split("."):
        value = value[part]
    return value


def algorithm(stage: str, tree: dict) -> tuple[str, str]:
    """(what the card calls the training algorithm, its hub tag)."""
    if stage == "ppo":
        return ESTIMATORS[tree["ppo"]["estimator"]]
    if stage == "dpo":
        d = tree["dpo"]
        if d["loss_type"] in DPO_LOSSES:
            return DPO_LOSSES[d["loss_type"]]
        return ("conservative DPO" if d["label_smoothing"] > 0 else "DPO"), "dpo"
    return ALGORITHMS[stage]


def settings(stage: str, tree: dict) -> dict:
    """The card's table of settings: {dotted key: value}, empty values left out."""
    keys = STAGE_KEYS[stage] + COMMON_KEYS + (LORA_KEYS if tree["lora"]["enabled"] else ())
    values = {k: lookup(tree, k) for k in keys}
    return {k: v for k, v in values.items() if v not in ("", "none", None, [], ())}


def front_matter(facts: CardFacts) -> str:
    """The YAML block between --- lines that the hub reads as metadata."""
    _, tag = algorithm(facts.stage, facts.config)
    meta: dict = {"library_name": "peft" if facts.kind == "adapter" else "transformers"}
    if facts.base_on_hub:
        meta["base_model"] = facts.base_model
    meta["tags"] = ["rlhf_dist", tag] + (["value-model"] if facts.kind == "critic" else [])
    if facts.hub_datasets:
        meta["datasets"] = list(dict.fromkeys(facts.hub_datasets))
    return "---\n" + yaml.safe_dump(meta, sort_keys=False) + "---\n"


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    if isinstance(value, (list, tuple)):
        return ", ".join(str(v) for v in value)
    return str(value).replace("|", "\\|")


def _table(rows: dict, head: tuple[str, str]) -> list[str]:
    lines = [f"| {head[0]} | {head[1]} |", "| --- | --- |"]
    return lines + [f"| `{k}` | {_cell(v)} |" for k, v in rows.items()]


def headline_metrics(summary: dict) -> dict:
    """The summary's numbers (nested reports and texts left to summary.json)."""
    return {
        k: v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def how_to_load(facts: CardFacts) -> list[str]:
    """A Python snippet that loads this export."""
    where = repr(facts.load_from)
    extra = f", subfolder={facts.subfolder!r}" if facts.subfolder else ""
    if facts.kind == "adapter":
        base = facts.base_model
        return [
            "from peft import PeftModel",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "",
            f"base = AutoModelForCausalLM.from_pretrained({base!r})",
            f"model = PeftModel.from_pretrained(base, {where}{extra})",
            f"tokenizer = AutoTokenizer.from_pretrained({where}{extra})",
        ]
    cls = KINDS[facts.kind][1]
    return [
        f"from transformers import {cls}, AutoTokenizer",
        "",
        f"model = {cls}.from_pretrained({where}{extra})",
        f"tokenizer = AutoTokenizer.from_pretrained({where}{extra})",
    ]


def card_text(facts: CardFacts) -> str:
    """The whole README.md of one export."""
    tree = facts.config
    name, _ = algorithm(facts.stage, tree)
    data, what = tree["data"], KINDS[facts.kind][0]
    lines = [
        f"# {facts.load_from}{'/' + facts.subfolder if facts.subfolder else ''}",
        "",
        f"{what}, trained by rlhf_dist (`rlhf-dist {facts.stage}`) with {name}.",
        "",
        f"- **Base model**: `{facts.base_model}`",
        f"- **Training data** (`data.train`): `{data['train']}`",
    ]
    if data["eval"]:
        lines.append(f"- **Evaluation data** (`data.eval`): `{data['eval']}`")
    lines += [f"- **Exported**: {facts.date}", "", "## Settings", ""]
    lines += _table(settings(facts.stage, tree), ("key", "value"))
    lines += ["", "The run's whole effective config is `config.yaml` in its run directory.", ""]
    metrics = headline_metrics(facts.metrics)
    if metrics:
        lines += ["## Results (summary.json)", ""] + _table(metrics, ("metric", "value")) + [""]
    lines += ["## How to load", "", "```python", *how_to_load(facts), "```", ""]
    return front_matter(facts) + "\n" + "\n".join(lines)
