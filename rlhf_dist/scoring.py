"""Frozen rewards: a user's reward function or a reward model, and scoring token
sequences with a reward model on every rank (the rephrasing probe of docs/rm_diagnostics.md).

Shared by PPO (rollout scores), reward-model training (held-out diagnostics) and
`rlhf-dist eval`, so it lives outside the trainers.
"""

from __future__ import annotations

import importlib
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlhf_dist import diagnostics as diag
from rlhf_dist.config import ConfigError, RewardFunctionError
from rlhf_dist.data import right_pad
from rlhf_dist.models import ValueModel, frozen_dtype, load_sequence_classifier, sequence_scores


class RewardFunction:
    """A user's `module:callable(prompts, responses) -> list[float]`, checked on every call."""

    def __init__(self, spec: str):
        module_name, _, attr = spec.partition(":")
        try:
            fn = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError, ValueError) as e:
            raise ConfigError(f"reward.function: cannot import {spec!r} ({e})") from None
        if not callable(fn):
            raise ConfigError(f"reward.function: {spec!r} is not callable")
        self.spec, self.fn = spec, fn

    def __call__(self, prompts: list[str], responses: list[str]) -> torch.Tensor:
        try:
            out = list(self.fn(prompts, responses))
        except Exception as e:
            raise RewardFunctionError(
                f"reward.function {self.spec} raised {type(e).__name__}: {e}"
            ) from e
        if len(out) != len(responses):
            raise RewardFunctionError(
                f"reward.function {self.spec} returned {len(out)} scores for {len(responses)} responses"
            )
        bad = [v for v in out if not _is_finite_number(v)]
        if bad:
            raise RewardFunctionError(
                f"reward.function {self.spec} returned a non-finite or non-number: {bad[0]!r}"
            )
        return torch.tensor([float(v) for v in out], dtype=torch.float32)


def _is_finite_number(v) -> bool:
    """A real, finite number (python, numpy or 0-dim torch), never a bool or a string."""
    if isinstance(v, (bool, str, bytes)) or not isinstance(v, numbers.Real | torch.Tensor):
        return False
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


@dataclass
class Scorer:
    """Scores whole sequences with a reward model or a reward function."""

    reward_model: ValueModel | None = None
    reward_fn: Callable | None = None

    @torch.no_grad()
    def __call__(self, prompts, responses, input_ids, attention_mask, last_index) -> torch.Tensor:
        """prompts/responses: B texts; input_ids/attention_mask (B, P+T); last_index (B,)."""
        if self.reward_fn is not None:
            return self.reward_fn(prompts, responses).to(input_ids.device)
        return sequence_scores(self.reward_model, input_ids, attention_mask, last_index).float()


def build_scorer(runtime, reward_function: str, model_cfg, placement: str) -> Scorer:
    """The frozen reward: the Python function `reward_function` ("module:callable") if set,
    else model_cfg.reward loaded as a ValueModel and prepared as a frozen model with
    `placement` (distributed.frozen_models, or "replicate")."""
    if reward_function:
        return Scorer(reward_fn=RewardFunction(reward_function))
    m, dtype = model_cfg, frozen_dtype(model_cfg)
    with runtime.local_loading():
        rm = load_sequence_classifier(m.reward, "model.reward", dtype, m)
    rm = runtime.prepare_frozen(ValueModel(rm), placement, dtype, "reward model")
    return Scorer(reward_model=rm)


def lockstep_chunks(runtime, n_items: int, size: int):
    """Slices of `size` over this rank's n_items, then None until every rank is done.

    Ranks' shares differ in length, but each forward pass of a prepared model may be a
    collective (ZeRO-3 gathers every layer's weights; DDP broadcasts buffers), so every
    rank must run as many passes as the busiest one: a None asks for a throw-away pass.
    """
    mine = -(-n_items // size)
    total = int(runtime.all_max(torch.tensor(mine, dtype=torch.long)))
    for i in range(total):
        yield slice(i * size, (i + 1) * size) if i < mine else None


@torch.no_grad()
def score_sequences(runtime, value_model, seqs: list[list[int]], batch_size: int, pad_id: int):
    """Scores (len(seqs),) on CPU of whole token sequences, each read at its last token.

    Every rank must call this (lock-step passes, see lockstep_chunks), each with its own seqs.
    """
    out = []
    for s in lockstep_chunks(runtime, len(seqs), batch_size):
        ids, mask = right_pad(seqs[s] if s else [[pad_id]], pad_id)
        ids, mask = ids.to(runtime.device), mask.to(runtime.device)
        scores = sequence_scores(value_model, ids, mask, mask.sum(1) - 1)
        if s:
            out.append(scores.float().cpu())
    return torch.cat(out) if out else torch.zeros(0)


def probe_rephrasings(runtime, value_model, responses, scores, filler, batch_size, pad_id) -> dict:
    """The rephrasing probe over every rank's `responses` (diagnostics.Response, this rank's
    share) with their known `scores` (N,); `filler` is also the droppable tail. Returns
    diagnostics.rephrase_summary of all ranks together. Every rank must call this."""
    longer, shorter = diag.rephrasings(responses, filler, [filler])
    up = score_sequences(runtime, value_model, longer, batch_size, pad_id)
    down = score_sequences(runtime, value_model, [s for _, s in shorter], batch_size, pad_id)
    base = torch.as_tensor(scores, dtype=torch.float64).reshape(-1)
    part = (base.tolist(), up.tolist(), base[[i for i, _ in shorter]].tolist(), down.tolist())
    parts = runtime.gather_objects([part])
    return diag.rephrase_summary(*([x for p in parts for x in p[k]] for k in range(4)))
