"""Step 1 of a PPO iteration, the prompts (docs/architecture.md section 5): data.train's
usable prompts, each iteration's global batch in a seed-determined order, this rank's
slice of it with every prompt n = ppo.samples_per_prompt times in a row, and dynamic
sampling's extra batches."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

from rlhf_dist.config import Config
from rlhf_dist.data.batching import PPOPlan, extra_batch, global_batches
from rlhf_dist.data.rows import PromptSet, load_data, prompt_set
from rlhf_dist.data.vision import VisionInputs
from rlhf_dist.distributed import Runtime
from rlhf_dist.errors import ConfigError
from rlhf_dist.rewards.scoring import check_reward_columns
from rlhf_dist.rollout import PromptBatch

if TYPE_CHECKING:  # transformers loads only where a tokenizer does
    from transformers import PreTrainedTokenizerBase

Item = TypeVar("Item")


def training_prompts(
    cfg: Config, tokenizer: PreTrainedTokenizerBase, vision: VisionInputs | None = None
) -> PromptSet:
    """data.train's usable prompts (`data.prompt_set`), at least one rollout batch of them,
    whose columns every reward function that names one finds (check_reward_columns);
    with `vision` (a vision-language policy), prompts may hold images (docs/vision.md)."""
    d, p = cfg.data, cfg.ppo
    where = f"data.train {d.train!r}"
    prompts = prompt_set(load_data(d, "train"), tokenizer, d, where, vision)
    if len(prompts.ids) < p.rollout_batch_size:
        raise ConfigError(
            f"ppo.rollout_batch_size: {p.rollout_batch_size} is more than the {len(prompts.ids)} usable prompts"
        )
    columns = {name for row in prompts.columns for name in row}
    check_reward_columns(cfg.reward, columns, f"data.train {d.train!r}")
    return prompts


def prompt_stream(
    prompts: PromptSet,
    plan: PPOPlan,
    runtime: Runtime,
    seed: int,
    pad_id: int,
    skip: int = 0,
    repeat_first: bool = False,
) -> Iterator[PromptBatch]:
    """Yield this rank's (prompt_ids, prompt_mask, texts) per iteration, cycling epochs;
    `skip` iterations are passed over (resume): the order depends only on the seed.
    Each prompt comes n = plan.samples_per_prompt times in a row, so the n samples of a
    prompt (one group) are rows [g*n, (g+1)*n) of ONE rank's rollout: group statistics
    need no collective. repeat_first (debug.overfit_one_batch): the first batch, every
    iteration."""
    n, size = len(prompts.ids), plan.rollout.global_size
    batches = global_batches(n, size, seed, epochs=10**9)
    if repeat_first:
        batches = itertools.repeat(next(batches))
    for _, idx in itertools.islice(batches, skip, None):
        yield rank_prompts(prompts, plan, runtime, idx, pad_id)


def rank_prompts(
    prompts: PromptSet, plan: PPOPlan, runtime: Runtime, idx: list[int], pad_id: int
) -> PromptBatch:
    """This rank's prompts of the global batch `idx` (ids, mask, texts and the rows' other
    columns), each prompt n times in a row."""
    n = plan.samples_per_prompt
    mine = [i for i in idx[plan.rollout.rank_slice(runtime.rank)] for _ in range(n)]
    return PromptBatch.of(prompts, mine, pad_id, runtime.device)


def extra_prompts(
    prompts: PromptSet, plan: PPOPlan, runtime: Runtime, seed: int, pad_id: int, it: int
) -> Callable[[int], PromptBatch]:
    """round -> this rank's prompt batch of dynamic sampling's extra round `round` of
    iteration `it` (batching.extra_batch: a function of seed, it and round, so a resumed
    run draws the same; the main stream is untouched)."""

    def batch(round_: int) -> PromptBatch:
        idx = extra_batch(len(prompts.ids), plan.rollout.global_size, seed, it, round_)
        return rank_prompts(prompts, plan, runtime, idx, pad_id)

    return batch


def with_ahead(stream: Iterator[Item], depth: int) -> Iterator[tuple[Item, list[Item]]]:
    """(this item, the next `depth` items, fewer at the end) for each item of `stream`."""
    window = [item for _, item in zip(range(depth + 1), stream)]
    while window:
        yield window[0], window[1:]
        window = window[1:] + [item for _, item in zip(range(1), stream)]
