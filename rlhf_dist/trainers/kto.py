"""Kahneman-Tversky optimisation (Ethayarajh et al. 2024) on unpaired labelled completions.

Each example is a prompt, a completion and a label (desirable or not); preference pairs give
desirable chosen and undesirable rejected completions. The loss compares each completion's
log-ratio r = log pi - log pi_ref with the reference point z0, an estimate of KL(pi || pi_ref)
from MISMATCHED pairs: each example's prompt with another example's completion
(`KTOExample.kl_completion`). z0 is the mean over the WHOLE global batch (all ranks, all
micro-batches), from a no-grad pass before the step's backward passes, detached and clamped
at 0, so the step's gradient does not depend on how the batch is split; each micro-batch's
loss is its example-loss SUM over the global example count (architecture.md section 4).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from rlhf_dist.algo.preference import kto_reference_point, kto_terms
from rlhf_dist.config import Config, KTOConfig, PerfConfig
from rlhf_dist.data.batching import BatchPlan, stage_plan
from rlhf_dist.data.rows import KTOExample, SFTExample, kto_examples, load_data
from rlhf_dist.data.vision import VisionInputs
from rlhf_dist.distributed import Runtime, lockstep_map
from rlhf_dist.engine.forward import DEFAULT_PERF
from rlhf_dist.errors import ConfigError
from rlhf_dist.models import tokenizer_for
from rlhf_dist.models.moe import RouterAux
from rlhf_dist.models.vision import policy_vision
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
    reference_logprobs,
    reference_table,
    response_batch,
    response_logprobs,
)
from rlhf_dist.trainers.publish import publish

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CONSOLE = ("kto/loss", "kto/kl", "rewards/margins")


def completion_sequences(examples: Sequence[KTOExample]) -> list[SFTExample]:
    """Each example's prompt with its own completion (the loss is on the completion)."""
    return [
        SFTExample(ex.prompt + ex.completion, len(ex.prompt), media=ex.media) for ex in examples
    ]


def mismatched_sequences(examples: Sequence[KTOExample]) -> list[SFTExample]:
    """Each example's prompt with another example's completion (KTO's KL estimate)."""
    return [
        SFTExample(ex.prompt + ex.kl_completion, len(ex.prompt), media=ex.media) for ex in examples
    ]


@torch.no_grad()
def global_reference_point(
    runtime: Runtime,
    model: nn.Module,
    reference: nn.Module | None,
    share: Sequence[KTOExample],
    kl_ref: torch.Tensor | None,
    plan: BatchPlan,
    pad_id: int,
    perf: PerfConfig,
) -> torch.Tensor:
    """z0 of one global batch: mean log-ratio of its mismatched pairs over all ranks.

    share: this rank's examples; kl_ref: their mismatched pairs' reference log-probs (m,)
    from the table, or None to run the reference. Returns a 0-dim tensor. Forward-only, so
    in lock-step passes (distributed/lockstep.py), though BatchPlan gives equal shares.
    """

    def forward(chunk: list[tuple[SFTExample, torch.Tensor | None]]) -> torch.Tensor:
        seqs, refs = zip(*chunk)
        batch = response_batch(list(seqs), pad_id, runtime.device)
        policy = response_logprobs(model, batch, perf)
        # the reference now, or this chunk's rows of the table
        online = kl_ref is None
        ref = reference_logprobs(runtime, reference, batch, perf) if online else torch.stack(refs)
        return (policy.double() - ref.to(runtime.device).double()).sum()

    refs = [None] * len(share) if kl_ref is None else list(kl_ref)  # 0-dim rows
    items = list(zip(mismatched_sequences(share), refs))
    filler = [(SFTExample([pad_id, pad_id], 1), torch.zeros(()))]
    total = torch.zeros((), dtype=torch.float64, device=runtime.device)
    for part in lockstep_map(runtime, items, plan.micro_batch_size, forward, filler):
        total += part
    return kto_reference_point(runtime.all_sum(total), plan.global_size).float()


def add_kto_stats(
    stats: StatSums, terms: dict[str, torch.Tensor], desirable: torch.Tensor, right: torch.Tensor
) -> None:
    """Sums of the logged KTO statistics over one micro-batch (docs/metrics.md)."""
    rewards, n = terms["rewards"], desirable.numel()
    stats.add("kto/loss", terms["loss"].detach().sum(), n)
    stats.add("rewards/desirable", rewards[desirable].sum(), desirable.sum())
    stats.add("rewards/undesirable", rewards[~desirable].sum(), (~desirable).sum())
    stats.add("rewards/accuracy", right.float().sum(), n)


def kto_step(
    runtime: Runtime,
    model: nn.Module,
    reference: nn.Module | None,
    examples: Sequence[KTOExample],
    ref_rows: torch.Tensor | None,
    plan: BatchPlan,
    kc: KTOConfig,
    pad_id: int,
    perf: PerfConfig = DEFAULT_PERF,
    aux: RouterAux | None = None,
) -> tuple[dict, dict[str, torch.Tensor]]:
    """z0, then backward over this rank's micro-batches of one global batch.

    ref_rows: (len(examples), 2) reference log-probs [completion, mismatched] from the table,
    or None (online). aux: a mixture-of-experts policy's load-balancing loss
    (trainers/moe_aux.py), or None. Returns the reduced statistics and this rank's rewards
    (histograms).
    """
    mine = plan.rank_slice(runtime.rank)
    share, rows = examples[mine], None if ref_rows is None else ref_rows[mine]
    kl_ref = None if rows is None else rows[:, 1]
    z0 = global_reference_point(runtime, model, reference, share, kl_ref, plan, pad_id, perf)
    widths = [len(ex.prompt) + len(ex.completion) for ex in examples]
    stats, rewards, slices = StatSums(), [], plan.micro_batches(widths, runtime.rank)
    own_micro = [([share[j] for j in s], None if rows is None else rows[s, 0]) for s in slices]
    # distributed.sequence_parallel_size: the group's micro-batches, each split by columns
    pooled = runtime.pool_micro_batches(own_micro)
    batches = [
        response_batch(completion_sequences(m), pad_id, runtime.device) for _, (m, _) in pooled
    ]
    routing = step_routing(  # mixture of experts: the global batch's expert fractions
        runtime,
        aux,
        [b["attention_mask"] for b in batches],
        lambda j: response_logprobs(model, batches[j], perf),
    )
    for i, (own, (micro, ref)) in enumerate(pooled):
        batch = batches[i]
        stats.add("kto/pad_fraction", *padding_cells(batch["attention_mask"]))
        with runtime.sequence_parallel():
            with recording(routing) as routed:
                logprobs = response_logprobs(model, batch, perf)  # (m,) log pi of each completion
            if ref is None:
                ref = reference_logprobs(runtime, reference, batch, perf)
        ref = ref.to(runtime.device)
        desirable = torch.tensor([ex.desirable for ex in micro], device=runtime.device)
        w = (kc.desirable_weight, kc.undesirable_weight)
        terms = kto_terms(logprobs, ref, desirable, z0, kc.beta, *w)
        loss = share_of_global_mean(runtime, terms["loss"].sum(), plan.global_size)
        if routing is not None:  # + coef x its share of the load-balancing loss
            loss = loss + routing.loss(runtime, routed, batch["attention_mask"], stats)
        runtime.micro_backward(model, loss, last=i == len(pooled) - 1)
        # On the right side of the reference point: the value v(x, y) is above half its weight.
        right = torch.where(desirable, logprobs > ref + z0, logprobs < ref + z0).detach()
        add_kto_stats(stats, terms, desirable, right)
        if own:  # the histograms: each example once, from the rank that owns it
            rewards.append(terms["rewards"].cpu())
    metrics = stats.reduce(runtime)
    metrics["rewards/margins"] = metrics["rewards/desirable"] - metrics["rewards/undesirable"]
    return metrics | {"kto/kl": float(z0)}, {"reward": torch.cat(rewards)}


def load_kto_examples(
    cfg: Config,
    runtime: Runtime,
    tokenizer: PreTrainedTokenizerBase,
    vision: VisionInputs | None = None,
) -> tuple[list[KTOExample], list[KTOExample]]:
    """Training and held-out examples (data.eval, same formats; [] without it); with
    `vision`, prompts with images (docs/vision.md)."""
    rows = load_data(cfg.data, "train")
    where = f"data.train {cfg.data.train!r}"
    train, report = kto_examples(rows, tokenizer, cfg.data, cfg.kto, where, vision)
    desirable = sum(ex.desirable for ex in train)
    runtime.print(
        f"{report.summary('kto examples')} ({desirable} desirable, {len(train) - desirable} undesirable)"
    )
    if len(train) < cfg.kto.batch_size:
        raise ConfigError(
            f"kto.batch_size: {cfg.kto.batch_size} is more than the {len(train)} usable examples ({report.summary('kto examples')})"
        )
    evals: list[KTOExample] = []
    if cfg.data.eval:
        rows = load_data(cfg.data, "eval")
        where = f"data.eval {cfg.data.eval!r}"
        evals = kto_examples(rows, tokenizer, cfg.data, cfg.kto, where, vision)[0]
    return train, evals


def evaluate_kto(
    runtime: Runtime,
    model: nn.Module,
    reference: nn.Module | None,
    evals: Sequence[KTOExample],
    ref_table: torch.Tensor | None,
    kc: KTOConfig,
    pad_id: int,
    perf: PerfConfig = DEFAULT_PERF,
) -> dict:
    """Held-out KTO loss, reference point z0 (`kl`), share of examples on the right side of
    it (`accuracy`) and reward margin over `evals`, the whole held-out set as one batch
    (every rank scores a share in lock-step: trainers/preference.all_response_logprobs).

    ref_table: (2N,) reference log-probs [completions, mismatched pairs], or None to score
    them with `reference` now."""
    seqs, size = completion_sequences(evals) + mismatched_sequences(evals), 2 * kc.micro_batch_size
    policy = all_response_logprobs(runtime, model, seqs, size, pad_id, perf).double()
    if ref_table is None:
        ref_table = all_response_logprobs(runtime, reference, seqs, size, pad_id, perf)
    ref, n = ref_table.double(), len(evals)
    z0 = kto_reference_point((policy[n:] - ref[n:]).sum(), n)
    desirable = torch.tensor([ex.desirable for ex in evals])
    w = (kc.desirable_weight, kc.undesirable_weight)
    terms = kto_terms(policy[:n], ref[:n], desirable, z0, kc.beta, *w)
    right = torch.where(desirable, policy[:n] > ref[:n] + z0, policy[:n] < ref[:n] + z0)
    out = {"loss": float(terms["loss"].mean()), "kl": float(z0)}
    out["accuracy"] = float(right.double().mean())
    rewards = terms["rewards"]
    if desirable.any() and not desirable.all():  # a margin needs both kinds of example
        out["margins"] = float(rewards[desirable].mean() - rewards[~desirable].mean())
    return out


def train_kto(cfg: Config, runtime: Runtime) -> dict:
    """Train the policy with KTO as configured; returns the summary.json content."""
    ckpt, kc = find_resume(cfg, runtime), cfg.kto
    tokenizer = tokenizer_for(cfg, "policy")
    vision = policy_vision(cfg)  # None for a text policy
    train, evals = load_kto_examples(cfg, runtime, tokenizer, vision)
    trained, plan, batches = build_policy(cfg, runtime, kc, len(train), ckpt)
    model, pad = trained[0], tokenizer.pad_token_id
    reference = build_reference(cfg, runtime, model)
    out, logger = open_run(cfg, runtime, "kto", ckpt, len(batches))
    aux = trained_router_aux(cfg.model.router_aux_loss_coef, model)
    table = eval_table = None
    if kc.reference_logprobs == "precompute":
        seqs = completion_sequences(train) + mismatched_sequences(train)
        seqs += completion_sequences(evals) + mismatched_sequences(evals)
        rows = 2 * stage_plan(kc, runtime.world_size).micro_batch_size
        full = reference_table(cfg, runtime, reference, seqs, rows, pad, out)
        n = len(train)
        table = full[: 2 * n].view(2, n).T  # (N, 2): completion, mismatched
        eval_table = full[2 * n :]
        if not cfg.lora.enabled:
            reference = None  # every reference log-prob is in the table: free the copy

    def step(idx: list[int]) -> dict:
        rows = None if table is None else table[idx]
        share = [train[i] for i in idx]
        metrics, values = kto_step(
            runtime, model, reference, share, rows, plan, kc, pad, cfg.perf, aux
        )
        norms = step_and_schedule(runtime, trained, [kc.optim.max_grad_norm])
        return metrics | {"kto/grad_norm": norms[0] if norms else None, DISTRIBUTIONS: values}

    def evaluate() -> dict:  # run.eval_every: held-out loss, z0, accuracy, margins
        return evaluate_kto(runtime, model, reference, evals, eval_table, kc, pad, cfg.perf)

    last = step_loop(
        cfg,
        runtime,
        out,
        logger,
        ckpt,
        trained,
        batches,
        step,
        "kto",
        CONSOLE,
        evaluate if evals else None,
    )
    desirable = sum(ex.desirable for ex in train)
    summary = {
        "steps": len(batches),
        "train_desirable": desirable,
        "train_undesirable": len(train) - desirable,
        "train_loss": last.get("kto/loss"),
        "train_kl": last.get("kto/kl"),
        "train_margins": last.get("rewards/margins"),
    }
    if evals:
        numbers = evaluate()
        logger.log(len(batches), {f"kto/eval_{k}": v for k, v in numbers.items()}, ())
        summary |= {f"eval_{k}": v for k, v in numbers.items()}
    export_policy(cfg, runtime, model, tokenizer, out, vision)
    write_summary(runtime, out, summary)
    logger.close()
    publish(cfg, runtime, out, "kto", summary)
    return summary
