"""Supervised fine-tuning: next-token loss on response tokens only.

The loss of one optimizer step is the sum of response-token NLLs divided by the number
of response tokens in the WHOLE global batch, so its gradient does not depend on how
the batch is split into ranks and micro-batches.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from rlhf_dist.algo.masking import masked_sum
from rlhf_dist.config import Config, PerfConfig
from rlhf_dist.data.batching import BatchPlan, stage_plan
from rlhf_dist.data.rows import SFT_KEYS, SFTExample, collate_sft, load_data, sft_examples
from rlhf_dist.data.vision import Media, VisionInputs
from rlhf_dist.distributed import Runtime, lockstep_map
from rlhf_dist.engine.forward import DEFAULT_PERF, token_logprobs
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
from rlhf_dist.trainers.preference import build_policy, export_policy
from rlhf_dist.trainers.publish import publish

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class LogprobsFn(Protocol):
    """logprobs_fn(model, input_ids, attention_mask, predict_mask, media=...) -> (log-probs
    (B, L-1), _); media: a vision batch's pixel inputs (data/vision.py) or None."""

    def __call__(
        self,
        model: nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        predict_mask: torch.Tensor,
        *,
        media: Media | None = None,
    ) -> tuple[torch.Tensor, Any]: ...


def sequence_nll(
    model: nn.Module, batch: dict[str, torch.Tensor], logprobs_fn: LogprobsFn
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence (sum of response-token NLL, response-token count), each (B,).

    loss_mask (B, L-1) marks the shifted positions scored; only those reach the output
    head (engine.forward.token_logprobs). logprobs_fn(model, input_ids, attention_mask,
    predict_mask) -> (log-probs (B, L-1), _): `causal_lm_logprobs` of a causal LM, or
    PPO-ptx's actor pass of an ActorCritic (trainers/ppo/ptx.py)."""
    mask = batch["loss_mask"]
    # a vision batch's pixel inputs: every key beyond the text ones (data/vision.py)
    media = {k: v for k, v in batch.items() if k not in SFT_KEYS} or None
    logprobs, _ = logprobs_fn(model, batch["input_ids"], batch["attention_mask"], mask, media=media)
    return masked_sum(-logprobs, mask, dim=1), mask.sum(1)


def causal_lm_logprobs(perf: PerfConfig) -> LogprobsFn:
    """sequence_nll's logprobs_fn for a causal LM: token_logprobs with the run's speed paths."""
    return functools.partial(token_logprobs, perf=perf)


def token_nll_sum(
    model: nn.Module, batch: dict[str, torch.Tensor], logprobs_fn: LogprobsFn
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of NLL over loss_mask, token count) of one micro-batch (`sequence_nll`)."""
    nll, count = sequence_nll(model, batch, logprobs_fn)
    return nll.sum(), count.sum()


def sft_step(
    runtime: Runtime,
    model: nn.Module,
    examples: Sequence[SFTExample],
    plan: BatchPlan,
    pad_id: int,
    perf: PerfConfig = DEFAULT_PERF,
    aux: RouterAux | None = None,
) -> tuple[dict, dict[str, torch.Tensor]]:
    """Forward/backward every micro-batch of this rank's share; returns the global mean NLL
    (`sft/loss`) and padding share (`sft/pad_fraction`), and this rank's per-sequence
    values for the histograms (mean NLL, response length). aux: a mixture-of-experts
    model's load-balancing loss (trainers/moe_aux.py; `loss/router_aux`), or None."""
    share = examples[plan.rank_slice(runtime.rank)]
    groups = plan.micro_batches([len(ex.ids) for ex in examples], runtime.rank)
    micro = [collate_sft([share[i] for i in g], pad_id) for g in groups]
    local_tokens = sum(int(b["loss_mask"].sum()) for b in micro)
    total_tokens = runtime.all_sum(torch.tensor(float(local_tokens), device=runtime.device))
    stats, per_seq, lengths = StatSums(), [], []
    # distributed.sequence_parallel_size: the group's micro-batches, each split by columns
    pooled = runtime.pool_micro_batches(micro)
    on_device = [{k: v.to(runtime.device) for k, v in b.items()} for _, b in pooled]
    routing = step_routing(  # mixture of experts: the global batch's expert fractions
        runtime,
        aux,
        [b["attention_mask"] for b in on_device],
        lambda i: sequence_nll(model, on_device[i], causal_lm_logprobs(perf)),
    )
    for i, (own, batch) in enumerate(pooled):
        stats.add("sft/pad_fraction", *padding_cells(batch["attention_mask"]))
        batch = on_device[i]
        with runtime.sequence_parallel(), recording(routing) as routed:
            nll, count = sequence_nll(model, batch, causal_lm_logprobs(perf))
        loss = share_of_global_mean(runtime, nll.sum(), total_tokens)
        if routing is not None:  # + coef x its share of the load-balancing loss
            loss = loss + routing.loss(runtime, routed, batch["attention_mask"], stats)
        runtime.micro_backward(model, loss, last=i == len(pooled) - 1)
        stats.add("sft/loss", nll.sum().detach(), count.sum())
        if own:  # the histograms: each sequence once, from the rank that owns it
            per_seq.append((nll.detach() / count.clamp(min=1)).cpu())
            lengths.append(count.float().cpu())
    values = {"sequence_nll": torch.cat(per_seq), "response_length": torch.cat(lengths)}
    return stats.reduce(runtime), values


@torch.no_grad()
def eval_nll(
    runtime: Runtime,
    model: nn.Module,
    examples: Sequence[SFTExample],
    micro_batch_size: int,
    pad_id: int,
    perf: PerfConfig = DEFAULT_PERF,
) -> float:
    """Mean response-token NLL over `examples` (each rank takes every world_size-th), in
    lock-step passes (distributed/lockstep.py: under ZeRO-3 each forward is a collective)."""

    def forward(chunk: list[SFTExample]) -> torch.Tensor:
        batch = {k: v.to(runtime.device) for k, v in collate_sft(chunk, pad_id).items()}
        nll_sum, count = token_nll_sum(model, batch, causal_lm_logprobs(perf))
        return torch.stack([nll_sum, count.float()])

    mine = examples[runtime.rank :: runtime.world_size]
    filler = [SFTExample([pad_id, pad_id], 1)]  # one response token: a cheap pass
    totals = torch.zeros(2, device=runtime.device)
    for part in lockstep_map(runtime, mine, micro_batch_size, forward, filler):
        totals += part
    totals = runtime.all_sum(totals)
    return float(totals[0] / totals[1])


def load_sft_data(
    cfg: Config,
    runtime: Runtime,
    tokenizer: PreTrainedTokenizerBase,
    vision: VisionInputs | None = None,
) -> tuple[list[SFTExample], list[SFTExample]]:
    """(train, eval) examples of data.train and data.eval (eval: [] without it); a
    ConfigError when fewer usable train examples than sft.batch_size remain. `vision`:
    a vision-language policy's (models.vision.policy_vision): rows may hold images."""
    d = cfg.data
    rows = load_data(d, "train")
    train, report = sft_examples(rows, tokenizer, d, where=f"data.train {d.train!r}", vision=vision)
    runtime.print(report.summary("sft data"))
    evals: list[SFTExample] = []
    if d.eval:
        rows = load_data(d, "eval")
        where = f"data.eval {d.eval!r}"
        evals = sft_examples(rows, tokenizer, d, where=where, vision=vision)[0]
    if len(train) < cfg.sft.batch_size:
        raise ConfigError(
            f"sft.batch_size: {cfg.sft.batch_size} is more than the {len(train)} usable examples ({report.summary('sft data')})"
        )
    return train, evals


def train_sft(cfg: Config, runtime: Runtime) -> dict:
    """Run SFT as configured; returns the summary written to summary.json."""
    ckpt = find_resume(cfg, runtime)
    sc = cfg.sft
    tokenizer = tokenizer_for(cfg, "policy")
    vision = policy_vision(cfg)  # None for a text policy
    train, evals = load_sft_data(cfg, runtime, tokenizer, vision)
    # the policy, with LoRA adapters on it under lora.enabled (as DPO and KTO train it)
    trained, plan, batches = build_policy(cfg, runtime, sc, len(train), ckpt)
    model, pad = trained[0], tokenizer.pad_token_id
    out, logger = open_run(cfg, runtime, "sft", ckpt, len(batches))
    aux = trained_router_aux(cfg.model.router_aux_loss_coef, model)

    def step(idx: list[int]) -> dict:
        share = [train[i] for i in idx]
        metrics, values = sft_step(runtime, model, share, plan, pad, cfg.perf, aux)
        norms = step_and_schedule(runtime, trained, [sc.optim.max_grad_norm])
        norm = norms[0] if norms else None
        return metrics | {"sft/grad_norm": norm, DISTRIBUTIONS: values}

    def evaluate() -> dict:  # run.eval_every: held-out response-token NLL
        return {"loss": eval_nll(runtime, model, evals, sc.micro_batch_size, pad, cfg.perf)}

    last = step_loop(
        cfg,
        runtime,
        out,
        logger,
        ckpt,
        trained,
        batches,
        step,
        "sft",
        ("sft/loss", "sft/grad_norm"),
        evaluate if evals else None,
    )
    summary = {
        "steps": len(batches),
        "train_loss": last.get("sft/loss"),
        "train_examples": len(train),
    }
    if evals:
        summary["eval_loss"] = eval_nll(
            runtime,
            model,
            evals,
            stage_plan(sc, runtime.world_size).micro_batch_size,
            pad,
            cfg.perf,
        )
        logger.log(len(batches), {"sft/eval_loss": summary["eval_loss"]}, ("sft/eval_loss",))
    export_policy(cfg, runtime, model, tokenizer, out, vision)  # final/, final_adapter/
    write_summary(runtime, out, summary)
    logger.close()
    publish(cfg, runtime, out, "sft", summary)
    return summary
