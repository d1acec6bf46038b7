"""Direct preference optimisation: DPO, conservative DPO (label smoothing), IPO, and the
reference-free SimPO and ORPO.

The policy is trained on preference pairs, with no reward model and no sampling (Rafailov
et al. 2023): against its frozen starting point (DPO, IPO), or against nothing but itself
(SimPO, ORPO: no reference model is built or run). Chosen and rejected sequences of a
micro-batch go through ONE forward pass (stacked into 2B rows). Each micro-batch's loss is
its pair-loss SUM divided by the pair count of the whole global batch (times the world
size), plus for ORPO its chosen-token NLL SUM divided by the chosen-token count of the
whole global batch, so a step's gradient does not depend on how the batch is split
(architecture.md section 4). DPO's reference log-probs come from one pass before training
(dpo.reference_logprobs=precompute) or from a reference forward per micro-batch (online).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from rlhf_dist.algo.masking import masked_sum
from rlhf_dist.algo.preference import (
    dpo_loss,
    dpo_terms,
    orpo_loss,
    orpo_terms,
    sequence_logprobs,
    simpo_loss,
    simpo_terms,
)
from rlhf_dist.config import Config, DPOConfig, PerfConfig
from rlhf_dist.data.batching import BatchPlan, stage_plan
from rlhf_dist.data.rows import PreferencePair, SFTExample, load_data, preference_pairs
from rlhf_dist.data.vision import VisionInputs
from rlhf_dist.distributed import Runtime, strided_map
from rlhf_dist.engine.forward import DEFAULT_PERF, token_logprobs
from rlhf_dist.errors import ConfigError
from rlhf_dist.models import tokenizer_for
from rlhf_dist.models.moe import RouterAux
from rlhf_dist.models.vision import policy_vision
from rlhf_dist.names import REFERENCE_FREE_LOSSES
from rlhf_dist.observability.tracking import open_run, write_summary
from rlhf_dist.stats import StatSums
from rlhf_dist.trainers.common import (
    DISTRIBUTIONS,
    find_resume,
    padding_cells,
    share_of_global_mean,
    step_and_schedule,
    step_loop,
)
from rlhf_dist.trainers.moe_aux import recording, step_routing, trained_router_aux
from rlhf_dist.trainers.preference import (
    all_response_logprobs,
    build_policy,
    build_reference,
    export_policy,
    media_of,
    reference_logprobs,
    reference_table,
    response_batch,
    response_logprobs,
)
from rlhf_dist.trainers.publish import publish

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CONSOLE = ("dpo/loss", "rewards/accuracy", "rewards/margins")


def pair_sequences(pairs: Sequence[PreferencePair]) -> list[SFTExample]:
    """All chosen sequences, then all rejected ones: the (2B,) layout of one forward."""
    return [SFTExample(p.chosen, p.prompt_len, media=p.media) for p in pairs] + [
        SFTExample(p.rejected, p.prompt_len, media=p.media) for p in pairs
    ]


def add_pair_stats(stats: StatSums, terms: dict, logprobs: torch.Tensor) -> None:
    """Sums over this micro-batch's pairs of the logged DPO statistics (docs/metrics.md)."""
    chosen, rejected = terms["chosen_rewards"], terms["rejected_rewards"]
    n, half = chosen.numel(), logprobs.shape[0] // 2
    stats.add("dpo/loss", terms["loss"].detach().sum(), n)
    stats.add("rewards/chosen", chosen.sum(), n)
    stats.add("rewards/rejected", rejected.sum(), n)
    stats.add("rewards/margins", (chosen - rejected).sum(), n)
    stats.add("rewards/accuracy", (chosen > rejected).float().sum(), n)
    stats.add("logprobs/chosen", logprobs[:half].detach().sum(), n)
    stats.add("logprobs/rejected", logprobs[half:].detach().sum(), n)
    if "nll_sum" in terms:  # ORPO: the chosen-token NLL and the log odds ratio
        stats.add("dpo/nll", terms["nll_sum"].detach(), terms["nll_tokens"])
        stats.add("dpo/log_odds_ratio", terms["log_odds_ratio"].sum(), n)


def nll_mask(batch: dict[str, torch.Tensor], dc: DPOConfig) -> torch.Tensor:
    """(2m, L-1) bool: the tokens of ORPO's NLL term, on the m chosen rows (the first half).

    Their response tokens, and with dpo.orpo_prompt_nll their prompt tokens too: every real
    token after the first, as the ORPO authors' code and TRL's ORPOTrainer score the chosen
    sequence. All False for SimPO (no NLL term)."""
    mask = batch["response_mask"]
    out, half = torch.zeros_like(mask), mask.shape[0] // 2
    if dc.loss_type == "orpo":
        every = batch["attention_mask"][:, 1:].bool()
        out[:half] = every[:half] if dc.orpo_prompt_nll else mask[:half]
    return out


def nll_tokens(pairs: Sequence[PreferencePair], dc: DPOConfig) -> int:
    """How many tokens ORPO's NLL term covers over `pairs` (`nll_mask`'s count; 0 for SimPO)."""
    if dc.loss_type != "orpo":
        return 0
    if dc.orpo_prompt_nll:
        return sum(len(p.chosen) - 1 for p in pairs)
    return sum(sum(SFTExample(p.chosen, p.prompt_len).targets()[1:]) for p in pairs)


def reference_free_terms(
    model: nn.Module, batch: dict[str, torch.Tensor], dc: DPOConfig, perf: PerfConfig
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """SimPO or ORPO per-pair terms of one micro-batch of m pairs (2m rows, chosen first) from
    ONE forward of the policy alone; returns (terms, response log-prob sums (2m,)). ORPO's
    terms add `nll_sum` (0-dim, over `nll_mask`) and `nll_tokens`."""
    mask, nll = batch["response_mask"], nll_mask(batch, dc)
    ids, attention = batch["input_ids"], batch["attention_mask"]
    media = media_of(batch)
    logprobs, _ = token_logprobs(model, ids, attention, mask | nll, perf=perf, media=media)
    sums, lengths, half = sequence_logprobs(logprobs, mask), mask.sum(1), mask.shape[0] // 2
    chosen, rejected = (sums[:half], lengths[:half]), (sums[half:], lengths[half:])
    if dc.loss_type == "simpo":
        terms = simpo_terms(
            chosen[0],
            rejected[0],
            chosen[1],
            rejected[1],
            dc.beta,
            dc.simpo_gamma,
            dc.label_smoothing,
        )
        return terms, sums
    terms = orpo_terms(chosen[0], rejected[0], chosen[1], rejected[1], dc.beta)
    terms |= {"nll_sum": masked_sum(-logprobs, nll), "nll_tokens": nll.sum()}
    return terms, sums


def micro_terms(
    runtime: Runtime,
    model: nn.Module,
    reference: nn.Module | None,
    batch: dict[str, torch.Tensor],
    ref: torch.Tensor | None,
    dc: DPOConfig,
    perf: PerfConfig,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One micro-batch's per-pair terms and its policy log-prob sums (2m,): reference-free,
    or DPO/IPO against `ref` (the table's rows, chosen then rejected) or the reference run
    now (ref None)."""
    if dc.loss_type in REFERENCE_FREE_LOSSES:
        return reference_free_terms(model, batch, dc, perf)
    logprobs = response_logprobs(model, batch, perf)  # (2m,): m chosen, then m rejected
    if ref is None:
        ref = reference_logprobs(runtime, reference, batch, perf)
    half = logprobs.shape[0] // 2
    terms = dpo_terms(
        logprobs[:half],
        logprobs[half:],
        ref[:half],
        ref[half:],
        dc.beta,
        dc.loss_type,
        dc.label_smoothing,
    )
    return terms, logprobs


def dpo_step(
    runtime: Runtime,
    model: nn.Module,
    reference: nn.Module | None,
    pairs: Sequence[PreferencePair],
    ref_rows: torch.Tensor | None,
    plan: BatchPlan,
    dc: DPOConfig,
    pad_id: int,
    perf: PerfConfig = DEFAULT_PERF,
    aux: RouterAux | None = None,
) -> tuple[dict, dict[str, torch.Tensor]]:
    """Backward over this rank's micro-batches of one global batch.

    pairs: the global batch's PreferencePairs; ref_rows: (len(pairs), 2) reference log-probs
    [chosen, rejected] from the table, or None to run the reference (online) or for the
    reference-free losses. aux: a mixture-of-experts policy's load-balancing loss
    (trainers/moe_aux.py), or None. Returns the reduced statistics and this rank's
    per-pair margins for the histograms.
    """
    mine = plan.rank_slice(runtime.rank)
    share, rows = pairs[mine], None if ref_rows is None else ref_rows[mine]
    widths = [max(len(p.chosen), len(p.rejected)) for p in pairs]
    slices = plan.micro_batches(widths, runtime.rank, rows_per_item=2)  # chosen + rejected
    global_nll_tokens = nll_tokens(pairs, dc)  # every rank holds the whole global batch
    stats, margins = StatSums(), []
    micro = [
        (pair_sequences([share[j] for j in s]), None if rows is None else rows[s].T.reshape(-1))
        for s in slices
    ]
    # distributed.sequence_parallel_size: the group's micro-batches, each split by columns
    pooled = runtime.pool_micro_batches(micro)
    batches = [response_batch(seqs, pad_id, runtime.device) for _, (seqs, _) in pooled]
    routing = step_routing(  # mixture of experts: the global batch's expert fractions
        runtime,
        aux,
        [b["attention_mask"] for b in batches],
        lambda j: response_logprobs(model, batches[j], perf),
    )
    for i, (own, (_, ref)) in enumerate(pooled):
        batch = batches[i]
        stats.add("dpo/pad_fraction", *padding_cells(batch["attention_mask"]))
        ref = None if ref is None else ref.to(runtime.device)
        with runtime.sequence_parallel(), recording(routing) as routed:
            terms, logprobs = micro_terms(runtime, model, reference, batch, ref, dc, perf)
        # The pair-loss SUM over the global pair count, ORPO's NLL SUM over the global token
        # count: split-invariant (architecture.md s. 4).
        loss = share_of_global_mean(runtime, terms["loss"].sum(), plan.global_size)
        if routing is not None:  # + coef x its share of the load-balancing loss
            loss = loss + routing.loss(runtime, routed, batch["attention_mask"], stats)
        if "nll_sum" in terms:
            loss = loss + share_of_global_mean(runtime, terms["nll_sum"], global_nll_tokens)
        runtime.micro_backward(model, loss, last=i == len(pooled) - 1)
        add_pair_stats(stats, terms, logprobs)
        if own:  # the histograms: each pair once, from the rank that owns it
            margins.append((terms["chosen_rewards"] - terms["rejected_rewards"]).cpu())
    metrics = stats.reduce(runtime)
    if "dpo/nll" in metrics:  # ORPO's loss: the pair term's mean plus the token-mean NLL
        metrics["dpo/loss"] += metrics["dpo/nll"]
    return metrics, {"reward_margin": torch.cat(margins)}


def load_dpo_pairs(
    cfg: Config,
    runtime: Runtime,
    tokenizer: PreTrainedTokenizerBase,
    vision: VisionInputs | None = None,
) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """Training and held-out pairs (the `rm` formats: chosen/rejected or ranked responses;
    with `vision`, prompts with images: docs/vision.md)."""
    rows = load_data(cfg.data, "train")
    d, field = cfg.data, cfg.dpo.responses_field
    where = f"data.train {d.train!r}"
    train, report = preference_pairs(rows, tokenizer, d, field, where, vision)
    runtime.print(report.summary("preference pairs"))
    if len(train) < cfg.dpo.batch_size:
        raise ConfigError(
            f"dpo.batch_size: {cfg.dpo.batch_size} is more than the {len(train)} usable pairs ({report.summary('preference pairs')})"
        )
    evals: list[PreferencePair] = []
    if cfg.data.eval:
        rows = load_data(cfg.data, "eval")
        evals = preference_pairs(rows, tokenizer, d, field, f"data.eval {d.eval!r}", vision)[0]
    return train, evals


def evaluate_dpo(
    runtime: Runtime,
    model: nn.Module,
    reference: nn.Module | None,
    evals: Sequence[PreferencePair],
    ref_table: torch.Tensor | None,
    dc: DPOConfig,
    pad_id: int,
    perf: PerfConfig = DEFAULT_PERF,
) -> dict:
    """Held-out loss and reward accuracy/margin over `evals` (every rank scores a share).

    ref_table: the eval pairs' reference log-probs [all chosen, all rejected], or None to
    score them with `reference` now; both unused by the reference-free losses."""
    seqs, size = pair_sequences(evals), 2 * stage_plan(dc, runtime.world_size).micro_batch_size
    n = len(evals)
    if dc.loss_type in REFERENCE_FREE_LOSSES:
        loss, stats = reference_free_eval(runtime, model, seqs, size, dc, pad_id, perf)
    else:
        policy = all_response_logprobs(runtime, model, seqs, size, pad_id, perf)
        ref = (
            ref_table
            if ref_table is not None
            else all_response_logprobs(runtime, reference, seqs, size, pad_id, perf)
        )
        policy, ref = policy.double(), ref.double()
        loss, stats = dpo_loss(
            policy[:n], policy[n:], ref[:n], ref[n:], dc.beta, dc.loss_type, dc.label_smoothing
        )
    return {"eval_loss": float(loss), "eval_pairs": n} | {
        f"eval_{k}": float(v) for k, v in stats.items()
    }


@torch.no_grad()
def reference_free_eval(
    runtime: Runtime,
    model: nn.Module,
    seqs: list[SFTExample],
    size: int,
    dc: DPOConfig,
    pad_id: int,
    perf: PerfConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SimPO or ORPO (loss, stats) of the held-out pairs `seqs` ([all chosen, all rejected]),
    all of them as one batch; each rank scores a share in lock-step passes."""

    def forward(
        chunk: list[SFTExample],
    ) -> torch.Tensor:  # (rows, 2): over the response, over every token
        batch = response_batch(chunk, pad_id, runtime.device)
        every = batch["attention_mask"][:, 1:].bool()
        with runtime.autocast():
            ids, attention = batch["input_ids"], batch["attention_mask"]
            media = media_of(batch)
            logprobs, _ = token_logprobs(model, ids, attention, every, perf=perf, media=media)
        sums = [
            sequence_logprobs(logprobs, batch["response_mask"]),
            sequence_logprobs(logprobs, every),
        ]
        return torch.stack(sums, dim=1).float()

    filler = [SFTExample([pad_id, pad_id], 1)]
    scores = torch.tensor(strided_map(runtime, seqs, size, forward, filler), dtype=torch.float64)
    lengths = torch.tensor([sum(s.targets()[1:]) for s in seqs], dtype=torch.float64)
    n, sums = len(seqs) // 2, scores[:, 0]
    chosen, rejected = (sums[:n], lengths[:n]), (sums[n:], lengths[n:])
    if dc.loss_type == "simpo":
        return simpo_loss(
            chosen[0],
            rejected[0],
            chosen[1],
            rejected[1],
            dc.beta,
            dc.simpo_gamma,
            dc.label_smoothing,
        )
    if dc.orpo_prompt_nll:  # every token after the first, as `nll_mask`
        nll_sum, count = -scores[:n, 1].sum(), sum(len(s.ids) - 1 for s in seqs[:n])
    else:
        nll_sum, count = -chosen[0].sum(), chosen[1].sum()
    return orpo_loss(chosen[0], rejected[0], chosen[1], rejected[1], dc.beta, nll_sum, count)


def precomputed_tables(
    cfg: Config,
    runtime: Runtime,
    reference: nn.Module,
    pairs: tuple[list[PreferencePair], list[PreferencePair]],
    pad: int,
    out: Path,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dpo.reference_logprobs=precompute: the reference's sequence log-probs of the training
    pairs (N, 2: chosen, rejected) and of the held-out pairs' sequences, in one pass."""
    train, evals = pairs
    seqs = pair_sequences(train) + pair_sequences(evals)
    micro = 2 * stage_plan(cfg.dpo, runtime.world_size).micro_batch_size
    full = reference_table(cfg, runtime, reference, seqs, micro, pad, out)
    n = len(train)
    return torch.stack([full[:n], full[n : 2 * n]], dim=1), full[2 * n :]


def train_dpo(cfg: Config, runtime: Runtime) -> dict:
    """Train the policy with DPO/cDPO/IPO/SimPO/ORPO as configured; returns the summary.json
    content."""
    ckpt, dc = find_resume(cfg, runtime), cfg.dpo
    tokenizer = tokenizer_for(cfg, "policy")
    vision = policy_vision(cfg)  # None for a text policy
    train, evals = load_dpo_pairs(cfg, runtime, tokenizer, vision)
    trained, plan, batches = build_policy(cfg, runtime, dc, len(train), ckpt)
    model, pad = trained[0], tokenizer.pad_token_id
    reference_free = dc.loss_type in REFERENCE_FREE_LOSSES  # SimPO, ORPO: no reference at all
    reference = None if reference_free else build_reference(cfg, runtime, model)
    out, logger = open_run(cfg, runtime, "dpo", ckpt, len(batches))
    aux = trained_router_aux(cfg.model.router_aux_loss_coef, model)
    table = eval_table = None
    if dc.reference_logprobs == "precompute" and not reference_free:
        table, eval_table = precomputed_tables(cfg, runtime, reference, (train, evals), pad, out)
        if not cfg.lora.enabled:
            reference = None  # every reference log-prob is in the table: free the copy

    def step(idx: list[int]) -> dict:
        rows = None if table is None else table[idx]
        share = [train[i] for i in idx]
        metrics, values = dpo_step(
            runtime, model, reference, share, rows, plan, dc, pad, cfg.perf, aux
        )
        norms = step_and_schedule(runtime, trained, [dc.optim.max_grad_norm])
        return metrics | {"dpo/grad_norm": norms[0] if norms else None, DISTRIBUTIONS: values}

    def evaluate() -> dict:  # run.eval_every: held-out loss, reward accuracy and margins
        numbers = evaluate_dpo(runtime, model, reference, evals, eval_table, dc, pad, cfg.perf)
        return {k.removeprefix("eval_"): v for k, v in numbers.items() if k != "eval_pairs"}

    last = step_loop(
        cfg,
        runtime,
        out,
        logger,
        ckpt,
        trained,
        batches,
        step,
        "dpo",
        CONSOLE,
        evaluate if evals else None,
    )
    summary = {
        "steps": len(batches),
        "train_pairs": len(train),
        "train_loss": last.get("dpo/loss"),
        "train_accuracy": last.get("rewards/accuracy"),
        "train_margins": last.get("rewards/margins"),
    }
    if evals:
        numbers = evaluate_dpo(runtime, model, reference, evals, eval_table, dc, pad, cfg.perf)
        logger.log(len(batches), {f"dpo/{k}": v for k, v in numbers.items()}, ())
        summary |= numbers
    export_policy(cfg, runtime, model, tokenizer, out, vision)
    write_summary(runtime, out, summary)
    logger.close()
    publish(cfg, runtime, out, "dpo", summary)
    return summary
