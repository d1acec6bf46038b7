"""DAPO dynamic sampling across ranks (Yu et al. 2025, section 3.2; docs/agents.md,
"Objectives"): groups whose n scores all tie carry no group-baseline signal, so they are
dropped and more prompts are rolled out until every rank's batch is full again.

Lock-step: a rollout is a collective under ZeRO-3 (generation and scoring fetch weights
from every rank), so ALL ranks run every extra round together, each rolling out its own
shard; whether another round is needed is one all-reduce (`any_rank`). After at most
`max_rounds` extra rounds a rank still short tops its batch up with tied groups, so every
rank trains on exactly as many groups as planned: the update's shapes, its optimizer-step
count and the split-invariant loss counts are those of a batch without dynamic sampling.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any

import torch

from rlhf_dist.algo.objectives import dynamic_sampling_selection, tied_groups
from rlhf_dist.data.vision import RowMedia
from rlhf_dist.distributed import Runtime
from rlhf_dist.rollout import PromptBatch, RolloutBatch


def rollout_until_full(
    runtime: Runtime,
    rollout: Callable,
    prompt_batch: PromptBatch,
    more_prompts: Callable,
    group_size: int,
    max_rounds: int,
    pad_id: int,
) -> tuple[RolloutBatch, list, list, dict, tuple[int, ...]]:
    """(batch, response texts, prompt texts, statistics, the rows' prompt indices
    (`PromptBatch.index`; () unless every round's prompts had them)) of this rank after
    dynamic sampling.

    rollout(prompt_batch) -> (RolloutBatch, texts) with the final (pre-normalisation)
    scores; prompt_batch: this rank's prompts, n rows per prompt; more_prompts(round) -> the prompt batch of extra round 1, 2, ... (the same on
    a resumed run: docs/architecture.md section 7). The kept groups are the untied ones in
    sampling order (dynamic_sampling_selection).
    """
    parts = [(*rollout(prompt_batch), list(prompt_batch.texts), list(prompt_batch.index))]
    target = parts[0][0].scores.shape[0] // group_size
    tied = [tied_groups(parts[0][0].scores, group_size)]
    rounds = 0
    while rounds < max_rounds and runtime.any_rank(int((~torch.cat(tied)).sum()) < target):
        rounds += 1
        extra = more_prompts(rounds)
        batch, texts = rollout(extra)
        parts.append((batch, texts, list(extra.texts), list(extra.index)))
        tied.append(tied_groups(batch.scores, group_size))
    tied = torch.cat(tied).cpu()
    pick = dynamic_sampling_selection(tied, target)
    rows = (pick[:, None] * group_size + torch.arange(group_size)).reshape(-1)
    merged = concat_rollouts([part[0] for part in parts], pad_id)
    texts = [t for part in parts for t in part[1]]
    prompts = [t for part in parts for t in part[2]]
    known = all(part[3] for part in parts)
    prompt_index = [i for part in parts for i in part[3]] if known else []
    counts = torch.tensor(
        [float(tied.sum()), float(tied.numel()), float(tied[pick].sum()), float(target)],
        dtype=torch.float64,
        device=runtime.device,
    )
    dropped, sampled, filled, wanted = runtime.all_sum(counts).tolist()
    stats = {
        "rollout/dynamic_sampling_drop_rate": dropped / sampled,
        "rollout/dynamic_sampling_rounds": float(rounds),
        "rollout/dynamic_sampling_groups": sampled,
        "rollout/dynamic_sampling_filled": filled / wanted,
    }
    index = rows.tolist()
    batch = merged.select(rows.to(merged.scores.device))
    kept = tuple(prompt_index[i] for i in index) if known else ()
    return batch, [texts[i] for i in index], [prompts[i] for i in index], stats, kept


def concat_rollouts(batches: list[RolloutBatch], pad_id: int) -> RolloutBatch:
    """Rollouts of different widths stacked row-wise into one RolloutBatch.

    Prompts are left-padded to the widest (PAD, mask 0) and response-aligned (B, T)
    tensors right-padded to the widest (response ids PAD, masks False, numbers 0), so each
    row keeps its tokens and positions (they come from the attention mask).
    """
    if len(batches) == 1:
        return batches[0]
    P = max(b.prompt_ids.shape[1] for b in batches)
    T = max(b.response_ids.shape[1] for b in batches)
    out: dict[str, Any] = {}
    for f in fields(RolloutBatch):
        xs = [getattr(b, f.name) for b in batches]
        if xs[0] is None:
            out[f.name] = None
            continue
        if isinstance(xs[0], RowMedia):  # a vision run's pixel inputs, per row
            out[f.name] = RowMedia.cat(xs)
            continue
        value = pad_id if f.name.endswith("_ids") else 0
        if f.name.startswith("prompt_"):
            xs = [_pad(x, P, value, left=True) for x in xs]
        elif xs[0].dim() == 2:
            xs = [_pad(x, T, value, left=False) for x in xs]
        out[f.name] = torch.cat(xs)
    return RolloutBatch(**out)


def _pad(x: torch.Tensor, width: int, value: float, left: bool) -> torch.Tensor:
    """(B, W) padded with `value` to (B, width) on the left or the right."""
    pad = torch.full((x.shape[0], width - x.shape[1]), value, dtype=x.dtype, device=x.device)
    return torch.cat([pad, x] if left else [x, pad], dim=1)
