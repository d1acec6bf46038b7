"""Reward model: Bradley-Terry loss on preference pairs, score at the last real token.

Chosen and rejected sequences of a micro-batch go through ONE forward pass (stacked
into 2B rows), so both are scored by the same weights with the same padding.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from rlhf_dist.algo.losses import pairwise_reward_loss, pairwise_reward_terms
from rlhf_dist.config import Config
from rlhf_dist.data.batching import BatchPlan, stage_plan
from rlhf_dist.data.chat import export_tokenizer
from rlhf_dist.data.rows import PreferencePair, collate_pairs, load_data, preference_pairs
from rlhf_dist.distributed import Runtime, strided_map
from rlhf_dist.errors import ConfigError
from rlhf_dist.files import atomic_write_text
from rlhf_dist.models import (
    ValueModel,
    load_sequence_classifier,
    sequence_scores,
    tokenizer_for,
    train_dtype,
    trained_load_dtype,
)
from rlhf_dist.observability import diagnostics as diag
from rlhf_dist.observability.tracking import open_run, write_summary
from rlhf_dist.rewards.scoring import probe_rephrasings
from rlhf_dist.stats import StatSums
from rlhf_dist.trainers.common import (
    DISTRIBUTIONS,
    find_resume,
    padding_cells,
    prepare_single_model,
    save_pretrained,
    share_of_global_mean,
    step_and_schedule,
    step_loop,
)
from rlhf_dist.trainers.publish import publish

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rlhf_dist.observability.tracking import MetricsLogger


def pair_scores(
    value_model: ValueModel, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen_scores, rejected_scores), each (B,), of a collate_pairs batch."""
    scores = sequence_scores(
        value_model, batch["input_ids"], batch["attention_mask"], batch["last_index"]
    )
    half = scores.shape[0] // 2
    return scores[:half], scores[half:]


def rm_step(
    runtime: Runtime,
    model: nn.Module,
    pairs: Sequence[PreferencePair],
    plan: BatchPlan,
    pad_id: int,
) -> tuple[dict, dict[str, torch.Tensor]]:
    """Backward over this rank's micro-batches; returns the global mean loss, accuracy and
    padding share (`rm/loss`, `rm/accuracy`, `rm/pad_fraction`) and this rank's per-pair
    values for the histograms (margin, chosen and rejected scores)."""
    share = pairs[plan.rank_slice(runtime.rank)]
    widths = [max(len(p.chosen), len(p.rejected)) for p in pairs]
    groups = plan.micro_batches(widths, runtime.rank, rows_per_item=2)  # chosen + rejected
    stats, seen = StatSums(), []
    for i, g in enumerate(groups):
        batch = collate_pairs([share[j] for j in g], pad_id)
        stats.add("rm/pad_fraction", *padding_cells(batch["attention_mask"]))
        batch = {k: v.to(runtime.device) for k, v in batch.items()}
        chosen, rejected = pair_scores(model, batch)
        seen.append(torch.stack([chosen.detach(), rejected.detach()]).cpu())
        loss_sum = pairwise_reward_terms(chosen, rejected).sum()
        loss = share_of_global_mean(runtime, loss_sum, plan.global_size)
        runtime.micro_backward(model, loss, last=i == len(groups) - 1)
        stats.add("rm/loss", loss_sum.detach(), len(g))
        stats.add("rm/accuracy", (chosen > rejected).float().sum(), len(g))
    chosen, rejected = torch.cat(seen, dim=1)
    values = {"margin": chosen - rejected, "chosen_score": chosen, "rejected_score": rejected}
    return stats.reduce(runtime), values


def expected_calibration_error(prob_chosen: torch.Tensor, n_bins: int = 10) -> float:
    """ECE of P(chosen preferred) = sigmoid(score difference) against the labels.

    prob_chosen: (N,). Each pair is folded to its predicted winner: confidence max(p, 1-p),
    correct iff p > 0.5; ECE = sum_bins |accuracy - confidence| * share of pairs in the bin.
    Computed from `diagnostics.reliability_bins`, so the ECE and the reliability diagram
    written to rm_diagnostics.json can never disagree.
    """
    return diag.ece_from_bins(diag.reliability_bins(prob_chosen, n_bins))


@dataclass
class PairEval:
    """Held-out pairs scored, in pair order and on every rank; each field (N,) or N items."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    categories: list[str | None]
    chosen_length: torch.Tensor  # response tokens, EOS included (whole sequence if unknown)
    rejected_length: torch.Tensor

    @property
    def diff(self) -> torch.Tensor:
        """(N,) score(chosen) - score(rejected): > 0 where a pair is ranked correctly."""
        return self.chosen - self.rejected


@torch.no_grad()
def evaluate_pairs(
    runtime: Runtime,
    value_model: nn.Module,
    pairs: Sequence[PreferencePair],
    micro_batch_size: int,
    pad_id: int,
    prompt_lengths: list[int] | None = None,
) -> tuple[dict, PairEval]:
    """Held-out loss, accuracy and calibration over all ranks' shares of `pairs`, and the
    per-pair scores, lengths and categories the diagnostics read (scored once, every rank
    its strided share in lock-step: distributed/lockstep.py)."""

    def forward(chunk: list[PreferencePair]) -> list[tuple[float, float]]:
        batch = {k: v.to(runtime.device) for k, v in collate_pairs(chunk, pad_id).items()}
        chosen, rejected = pair_scores(value_model, batch)
        return list(zip(chosen.float().tolist(), rejected.float().tolist()))

    filler = [PreferencePair([pad_id], [pad_id])]
    gathered = strided_map(runtime, pairs, micro_batch_size, forward, filler)
    prompt_lengths = prompt_lengths or [0] * len(pairs)
    ev = PairEval(
        torch.tensor([c for c, _ in gathered], dtype=torch.float64),
        torch.tensor([r for _, r in gathered], dtype=torch.float64),
        [p.category for p in pairs],
        torch.tensor([len(p.chosen) - n for p, n in zip(pairs, prompt_lengths)]),
        torch.tensor([len(p.rejected) - n for p, n in zip(pairs, prompt_lengths)]),
    )
    loss, accuracy = pairwise_reward_loss(ev.chosen, ev.rejected)
    metrics = {
        "accuracy": float(accuracy),
        "loss": float(loss),
        "ece": expected_calibration_error(torch.sigmoid(ev.diff)),
        "pairs": len(pairs),
    }
    return metrics, ev


def distinct_responses(
    evals: Sequence[PreferencePair], ev: PairEval
) -> tuple[list[diag.Response], list[float]]:
    """Each distinct held-out response once (a ranked list repeats them across pairs), as
    diagnostics.Response split at its prompt and its EOS, with its score."""
    seqs = [p.chosen for p in evals] + [p.rejected for p in evals]
    lengths = torch.cat([ev.chosen_length, ev.rejected_length]).tolist()
    scores = torch.cat([ev.chosen, ev.rejected]).tolist()
    found: dict[tuple[int, ...], tuple[diag.Response, float]] = {}
    for seq, n, score in zip(seqs, lengths, scores):
        start = len(seq) - n  # encode_response put the EOS last
        found.setdefault(tuple(seq), (diag.Response(seq[:start], seq[start:-1], seq[-1:]), score))
    return [r for r, _ in found.values()], [s for _, s in found.values()]


def rm_diagnostics(
    runtime: Runtime,
    model: nn.Module,
    evals: Sequence[PreferencePair],
    metrics: dict,
    ev: PairEval,
    batch_size: int,
    tokenizer: PreTrainedTokenizerBase,
) -> dict:
    """Everything rm_diagnostics.json holds (docs/rm_diagnostics.md), for non-empty `evals`
    scored as `ev`. Every rank must call this."""
    scores = torch.cat([ev.chosen, ev.rejected])
    lengths = torch.cat([ev.chosen_length, ev.rejected_length])
    filler_text, filler = diag.encode_filler(tokenizer)
    probe = {}
    if filler:  # the same tokenizer on every rank: all ranks probe or none does
        responses, base = distinct_responses(evals, ev)
        mine = slice(runtime.rank, None, runtime.world_size)
        pad = tokenizer.pad_token_id
        probe = probe_rephrasings(
            runtime, model, responses[mine], base[mine], filler, batch_size, pad
        )
    score_std = float(scores.std(correction=0))
    report = {
        **metrics,
        "accuracy_by_category": diag.accuracy_by_category(ev.diff, ev.categories),
        "reliability": diag.reliability_bins(torch.sigmoid(ev.diff)),
        "score": {"mean": float(scores.mean()), "std": score_std},
        "length": {
            "corr": diag.length_correlation(scores, lengths),
            "mean_chosen": float(ev.chosen_length.double().mean()),
            "mean_rejected": float(ev.rejected_length.double().mean()),
            "longer_wins": diag.longer_preferred(ev.diff, ev.chosen_length, ev.rejected_length),
        },
        "rephrase": {"filler": filler_text, **probe},
        "thresholds": {
            "length_corr": diag.LENGTH_CORR_LIMIT,
            "longer_rise": diag.LONGER_RISE_LIMIT,
            "longer_delta_min_std": diag.LONGER_DELTA_MIN_STD,
        },
    }
    report["warning"] = diag.length_bias_warning(
        report["length"]["corr"], probe.get("longer_rise"), probe.get("longer_delta"), score_std
    )
    return report


def headline(report: dict) -> dict:
    """The diagnostics logged as rm/eval_* and kept in summary.json (None values left out)."""
    rephrase = report["rephrase"]
    numbers = {
        "length_corr": report["length"]["corr"],
        "rephrase_longer_delta": rephrase.get("longer_delta"),
        "rephrase_longer_rise": rephrase.get("longer_rise"),
        "rephrase_shorter_delta": rephrase.get("shorter_delta"),
    }
    return {k: v for k, v in numbers.items() if v is not None}


def report_eval(
    cfg: Config,
    runtime: Runtime,
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    evals: Sequence[PreferencePair],
    prompt_lengths: list[int],
    out: Path,
    logger: MetricsLogger,
    step: int,
) -> dict:
    """Score the held-out pairs once; write rm_diagnostics.json, log rm/eval_*, print one
    warning line if the model looks like a length counter. Returns the eval_* summary."""
    batch_size, pad = (
        stage_plan(cfg.rm, runtime.world_size).micro_batch_size,
        tokenizer.pad_token_id,
    )
    metrics, ev = evaluate_pairs(runtime, model, evals, batch_size, pad, prompt_lengths)
    report = rm_diagnostics(runtime, model, evals, metrics, ev, batch_size, tokenizer)
    numbers = metrics | headline(report)
    if runtime.is_main:
        atomic_write_text(out / "rm_diagnostics.json", json.dumps(report, indent=2) + "\n")
    keys = ("rm/eval_accuracy", "rm/eval_ece", "rm/eval_length_corr")
    logger.log(step, {f"rm/eval_{k}": v for k, v in numbers.items()}, keys)
    if report["warning"]:
        runtime.print(f"rm: WARNING: {report['warning']} (see docs/rm_diagnostics.md)")
    return {f"eval_{k}": v for k, v in numbers.items()}


def eval_pairs(
    rows: list[dict], tokenizer: PreTrainedTokenizerBase, cfg: Config, where: str = "data.eval"
) -> tuple[list[PreferencePair], list[int]]:
    """Held-out pairs and each one's prompt length in tokens: the diagnostics measure
    RESPONSE length, and prompt lengths vary across pairs."""
    pairs = preference_pairs(rows, tokenizer, cfg.data, cfg.rm.responses_field, where)[0]
    return pairs, [p.prompt_len for p in pairs]


def load_pairs(
    cfg: Config, runtime: Runtime, tokenizer: PreTrainedTokenizerBase
) -> tuple[list[PreferencePair], list[PreferencePair], list[int]]:
    """Training pairs, held-out pairs and the held-out pairs' prompt lengths."""
    d, field = cfg.data, cfg.rm.responses_field
    rows = load_data(d, "train")
    train, report = preference_pairs(rows, tokenizer, d, field, f"data.train {d.train!r}")
    runtime.print(report.summary("preference pairs"))
    evals: list[PreferencePair] = []
    prompt_lengths: list[int] = []
    if d.eval:
        rows = load_data(d, "eval")
        evals, prompt_lengths = eval_pairs(rows, tokenizer, cfg, f"data.eval {d.eval!r}")
    if len(train) < cfg.rm.batch_size:
        raise ConfigError(
            f"rm.batch_size: {cfg.rm.batch_size} is more than the {len(train)} usable pairs ({report.summary('preference pairs')})"
        )
    return train, evals, prompt_lengths


def train_reward_model(cfg: Config, runtime: Runtime) -> dict:
    """Train a reward model as configured; returns the summary written to summary.json."""
    ckpt = find_resume(cfg, runtime)
    rc, m = cfg.rm, cfg.model
    key = "model.reward" if m.reward else "model.policy"
    tokenizer = tokenizer_for(cfg, key.split(".")[1])
    train, evals, prompt_lengths = load_pairs(cfg, runtime, tokenizer)
    dtype = trained_load_dtype(train_dtype(m), runtime.zero_stage is not None, frozen_base=False)
    classifier = load_sequence_classifier(m.reward or m.policy, key, dtype, m, new_head=True)
    net = ValueModel(classifier, cfg.perf)
    trained, plan, batches = prepare_single_model(cfg, runtime, net, rc, len(train), ckpt)
    model, pad = trained[0], tokenizer.pad_token_id
    out, logger = open_run(cfg, runtime, "rm", ckpt)

    def step(idx: list[int]) -> dict:
        metrics, values = rm_step(runtime, model, [train[i] for i in idx], plan, pad)
        norms = step_and_schedule(runtime, trained, [rc.optim.max_grad_norm])
        norm = norms[0] if norms else None
        return metrics | {"rm/grad_norm": norm, DISTRIBUTIONS: values}

    def evaluate() -> dict:  # run.eval_every: held-out loss, accuracy, calibration
        metrics, _ = evaluate_pairs(runtime, model, evals, rc.micro_batch_size, pad)
        return {k: metrics[k] for k in ("loss", "accuracy", "ece")}

    console = ("rm/loss", "rm/accuracy")
    last = step_loop(
        cfg,
        runtime,
        out,
        logger,
        ckpt,
        trained,
        batches,
        step,
        "rm",
        console,
        evaluate if evals else None,
    )
    summary = {
        "steps": len(batches),
        "train_loss": last.get("rm/loss"),
        "train_accuracy": last.get("rm/accuracy"),
        "train_pairs": len(train),
    }
    if evals:
        summary |= report_eval(
            cfg, runtime, model, tokenizer, evals, prompt_lengths, out, logger, len(batches)
        )
    export = export_tokenizer(tokenizer, cfg.data)
    save_pretrained(runtime, model, export, out / "final", "classifier", train_dtype(cfg.model))
    write_summary(runtime, out, summary)
    logger.close()
    publish(cfg, runtime, out, "rm", summary)
    return summary
