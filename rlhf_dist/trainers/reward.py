"""Reward model: Bradley-Terry loss on preference pairs, score at the last real token.

Chosen and rejected sequences of a micro-batch go through ONE forward pass (stacked
into 2B rows), so both are scored by the same weights with the same padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlhf_dist.algo.losses import pairwise_reward_loss
from rlhf_dist.batching import BatchPlan
from rlhf_dist.config import ConfigError
from rlhf_dist.data import collate_pairs, load_rows, preference_pairs
from rlhf_dist.models import ValueModel, load_sequence_classifier, sequence_scores, tokenizer_for
from rlhf_dist.trainers.common import (
    find_resume,
    open_run,
    prepare_single_model,
    save_pretrained,
    step_and_schedule,
    step_loop,
    write_summary,
)


def pair_scores(value_model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen_scores, rejected_scores), each (B,), of a collate_pairs batch."""
    scores = sequence_scores(
        value_model, batch["input_ids"], batch["attention_mask"], batch["last_index"]
    )
    half = scores.shape[0] // 2
    return scores[:half], scores[half:]


def rm_step(runtime, model, pairs, plan: BatchPlan, pad_id: int) -> tuple[float, float]:
    """Backward over this rank's micro-batches; returns global (mean loss, accuracy)."""
    share = pairs[plan.rank_slice(runtime.rank)]
    slices = plan.micro_slices()
    totals = torch.zeros(2, device=runtime.device)
    for i, s in enumerate(slices):
        batch = {k: v.to(runtime.device) for k, v in collate_pairs(share[s], pad_id).items()}
        chosen, rejected = pair_scores(model, batch)
        loss_sum = -F.logsigmoid(chosen - rejected).sum()
        # Sum over pairs / global pair count (x world size: ranks' gradients are averaged).
        runtime.micro_backward(
            model, loss_sum * runtime.world_size / plan.global_size, last=i == len(slices) - 1
        )
        totals += torch.stack([loss_sum.detach(), (chosen > rejected).float().sum()])
    totals = runtime.all_sum(totals) / plan.global_size
    return float(totals[0]), float(totals[1])


def expected_calibration_error(prob_chosen: torch.Tensor, n_bins: int = 10) -> float:
    """ECE of P(chosen preferred) = sigmoid(score difference) against the labels.

    prob_chosen: (N,). Each pair is folded to its predicted winner: confidence max(p, 1-p),
    correct iff p > 0.5; ECE = sum_bins |accuracy - confidence| * share of pairs in the bin.
    """
    confidence = torch.maximum(prob_chosen, 1 - prob_chosen)
    correct = (prob_chosen > 0.5).float()
    bins = torch.clamp(((confidence - 0.5) * 2 * n_bins).long(), max=n_bins - 1)
    ece = torch.zeros(())
    for b in range(n_bins):
        in_bin = bins == b
        if in_bin.any():
            gap = (correct[in_bin].mean() - confidence[in_bin].mean()).abs()
            ece += gap * in_bin.float().mean()
    return float(ece)


@torch.no_grad()
def evaluate_pairs(runtime, value_model, pairs, micro_batch_size: int, pad_id: int) -> dict:
    """Held-out loss, accuracy and calibration over all ranks' shares of `pairs`."""
    mine = pairs[runtime.rank :: runtime.world_size]
    diffs = []
    for i in range(0, len(mine), micro_batch_size):
        batch = {
            k: v.to(runtime.device)
            for k, v in collate_pairs(mine[i : i + micro_batch_size], pad_id).items()
        }
        chosen, rejected = pair_scores(value_model, batch)
        diffs.append((chosen - rejected).float().cpu())
    diff = torch.tensor(runtime.gather_objects(torch.cat(diffs).tolist() if diffs else []))
    loss, accuracy = pairwise_reward_loss(diff, torch.zeros_like(diff))
    return {
        "accuracy": float(accuracy),
        "loss": float(loss),
        "ece": expected_calibration_error(torch.sigmoid(diff)),
        "pairs": len(diff),
    }


def load_pairs(cfg, runtime, tokenizer):
    rows = load_rows(cfg.data.train, "data.train", cfg.data.split)
    train, report = preference_pairs(rows, tokenizer, cfg.data, cfg.rm.responses_field)
    runtime.print(report.summary("preference pairs"))
    evals = []
    if cfg.data.eval:
        evals = preference_pairs(
            load_rows(cfg.data.eval, "data.eval"), tokenizer, cfg.data, cfg.rm.responses_field
        )[0]
    if len(train) < cfg.rm.batch_size:
        raise ConfigError(
            f"rm.batch_size: {cfg.rm.batch_size} is more than the {len(train)} usable pairs ({report.summary('preference pairs')})"
        )
    return train, evals


def train_reward_model(cfg, runtime) -> dict:
    """Train a reward model as configured; returns the summary written to summary.json."""
    ckpt = find_resume(cfg, runtime)
    rc, m = cfg.rm, cfg.model
    key = "model.reward" if m.reward else "model.policy"
    tokenizer = tokenizer_for(cfg, key.split(".")[1])
    train, evals = load_pairs(cfg, runtime, tokenizer)
    net = ValueModel(load_sequence_classifier(m.reward or m.policy, key, m.dtype, m, new_head=True))
    trained, plan, batches = prepare_single_model(cfg, runtime, net, rc, len(train), ckpt)
    model, pad = trained[0], tokenizer.pad_token_id
    out, logger = open_run(cfg, runtime, "rm", ckpt)

    def step(idx) -> dict:
        loss, acc = rm_step(runtime, model, [train[i] for i in idx], plan, pad)
        norm = step_and_schedule(runtime, trained, rc.optim.max_grad_norm)
        return {"rm/loss": loss, "rm/accuracy": acc, "rm/grad_norm": norm}

    last = step_loop(
        cfg, runtime, out, logger, ckpt, trained, batches, step, "rm", ("rm/loss", "rm/accuracy")
    )
    summary = {
        "steps": len(batches),
        "train_loss": last.get("rm/loss"),
        "train_accuracy": last.get("rm/accuracy"),
        "train_pairs": len(train),
    }
    if evals:
        ev = evaluate_pairs(runtime, model, evals, rc.micro_batch_size, pad)
        summary |= {f"eval_{k}": v for k, v in ev.items()}
        logger.log(
            len(batches),
            {f"rm/eval_{k}": v for k, v in ev.items()},
            ("rm/eval_accuracy", "rm/eval_ece"),
        )
    save_pretrained(runtime, model, tokenizer, out / "final", "classifier")
    write_summary(runtime, out, summary)
    logger.close()
    return summary
