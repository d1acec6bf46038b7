"""TRL's SimPO (CPOTrainer, loss_type="simpo") and ORPOTrainer on the preference benchmark's
pairs (run in .venv-trl-grpo, TRL 1.16.0; vs_trl_preference.sh runs both sides).

Usage: python launch/bench/vs_trl_preference_trl.py PREPARED_DIR

PREPARED_DIR is what `vs_trl_preference_ours.py prepare` wrote. For each setting of its
settings.json this builds TRL's trainer on the same policy and hands it the same token ids
as one collated batch (TRL's own layout: chosen_/rejected_ input_ids, attention_mask, and
labels with -100 on the prompt and the padding), then records
- `metrics`: TRL's loss and logged metrics of `get_batch_loss_metrics` (its training
  loss: one forward of chosen and rejected concatenated), and grads/trl_*.pt the gradient
  of that loss;
- `chosen_mean` / `rejected_mean`: the per-pair mean log-probs of TRL's forward;
- `pair_loss`: TRL's per-pair loss function (`cpo_loss` / `odds_ratio_loss`) applied to OUR
  per-pair mean log-probs, in our sign (ORPO's term is -losses: TRL returns beta x log
  sigmoid and subtracts it).
Writes PREPARED_DIR/trl.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl.experimental.cpo import CPOConfig, CPOTrainer
from trl.experimental.orpo import ORPOConfig, ORPOTrainer


def collated(pairs: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """The batch TRL's DPODataCollatorWithPadding makes of tokenised rows, right-padded."""
    batch = {}
    for side in ("chosen", "rejected"):
        width = max(len(p[side]) for p in pairs)
        ids = torch.full((len(pairs), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(pairs), width), dtype=torch.long)
        labels = torch.full((len(pairs), width), -100, dtype=torch.long)
        for i, p in enumerate(pairs):
            seq, n = torch.tensor(p[side]), len(p[side])
            ids[i, :n], mask[i, :n] = seq, 1
            labels[i, p["prompt_len"] : n] = seq[p["prompt_len"] :]
        batch |= {
            f"{side}_input_ids": ids,
            f"{side}_attention_mask": mask,
            f"{side}_labels": labels,
        }
    return batch


def trainer_for(section: dict, policy: str, tokenizer, out: str):
    """TRL's trainer with the setting's numbers; the dataset it requires is never read."""
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    rows = Dataset.from_dict({"prompt": ["good"], "chosen": [" great"], "rejected": [" bad"]})
    common = {"output_dir": out, "use_cpu": True, "report_to": [], "max_length": 64,
              "beta": section["beta"], "per_device_train_batch_size": 1}  # fmt: skip
    if section["loss_type"] == "simpo":
        args = CPOConfig(
            **common, loss_type="simpo", cpo_alpha=0.0, simpo_gamma=section["simpo_gamma"],
            label_smoothing=section.get("label_smoothing", 0.0),
        )  # fmt: skip
        return CPOTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer)
    args = ORPOConfig(**common)
    return ORPOTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer)


def trl_for(name: str, section: dict, s: dict, pairs: list[dict], ours: dict, out: Path) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(s["policy"])
    with tempfile.TemporaryDirectory() as tmp:
        trainer = trainer_for(section, s["policy"], tokenizer, tmp)
    model, batch = trainer.model, collated(pairs, s["pad_id"])
    model.zero_grad()
    loss, metrics = trainer.get_batch_loss_metrics(model, batch)
    loss.backward()
    torch.save({n: p.grad for n, p in model.named_parameters()}, out / "grads" / f"trl_{name}.pt")
    with torch.no_grad():
        chosen, rejected = trainer.concatenated_forward(model, batch)[:2]
        ours_chosen = torch.tensor(ours["pairs"]["chosen_mean"])
        ours_rejected = torch.tensor(ours["pairs"]["rejected_mean"])
        if section["loss_type"] == "simpo":
            pair_loss = trainer.cpo_loss(ours_chosen, ours_rejected)[0]
        else:
            pair_loss = -trainer.odds_ratio_loss(ours_chosen, ours_rejected)[0]
    return {
        "metrics": {"loss": float(loss)} | {k: float(v) for k, v in metrics.items()},
        "chosen_mean": chosen.tolist(),
        "rejected_mean": rejected.tolist(),
        "pair_loss": pair_loss.tolist(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prepared", type=Path)
    out = ap.parse_args().prepared
    torch.set_num_threads(1)
    s = json.loads((out / "settings.json").read_text(encoding="utf-8"))
    pairs = json.loads((out / "pairs.json").read_text(encoding="utf-8"))
    ours = json.loads((out / "ours.json").read_text(encoding="utf-8"))
    result = {
        name: trl_for(section_name(section), section, s, pairs, ours[name], out)
        for name, section in s["settings"].items()
    }
    (out / "trl.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


def section_name(section: dict) -> str:
    """The gradient file's name, as vs_trl_preference_ours.py writes it."""
    return "_".join(f"{k}-{v}" for k, v in sorted(section.items()))


if __name__ == "__main__":
    main()
