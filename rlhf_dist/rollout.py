"""Rollout: generate responses, then score them with every model PPO needs.

generate (actor, sampling, left-padded prompts) -> truncate after the first EOS ->
old_logprobs + old_values (actor-critic forward, training dtype) -> ref_logprobs ->
scores (reward model at the last real token, or a Python reward function).
"""

from __future__ import annotations

import importlib
import math
import numbers
import time
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from rlhf_dist.algo.logprobs import entropy_from_logits, logprobs_from_logits
from rlhf_dist.algo.rewards import last_token_index
from rlhf_dist.config import ConfigError, RewardFunctionError
from rlhf_dist.models import ValueModel, position_ids_from, sequence_scores


@dataclass
class RolloutBatch:
    """One rank's rollout. Shapes: B sequences, P prompt tokens, T response tokens."""

    prompt_ids: torch.Tensor  # (B, P) left-padded
    prompt_mask: torch.Tensor  # (B, P) 1 on real prompt tokens
    response_ids: torch.Tensor  # (B, T) PAD after the first EOS
    response_mask: torch.Tensor  # (B, T) bool, True up to and including the first EOS
    old_logprobs: torch.Tensor  # (B, T)
    ref_logprobs: torch.Tensor  # (B, T)
    old_values: torch.Tensor  # (B, T)
    scores: torch.Tensor  # (B,) after the missing-EOS penalty
    raw_scores: torch.Tensor  # (B,) as the reward model / function gave them
    finished: torch.Tensor  # (B,) bool, the response ended with EOS
    entropy: torch.Tensor  # (B, T) of the sampling distribution

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.response_mask.long()], dim=1)

    def select(self, index) -> RolloutBatch:
        return RolloutBatch(**{f.name: getattr(self, f.name)[index] for f in fields(self)})


def truncate_after_eos(response_ids: torch.Tensor, eos_id: int, pad_id: int):
    """(ids, response_mask, finished): mask True up to and including the first EOS.

    response_ids: (B, T). Tokens after the first EOS become PAD (generate may already
    pad them); rows without EOS keep all T tokens and have finished=False.
    """
    is_eos = response_ids == eos_id
    # Number of EOS strictly before t: 0 means t is at or before the first EOS.
    eos_before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()
    mask = eos_before == 0
    ids = torch.where(mask, response_ids, torch.full_like(response_ids, pad_id))
    return ids, mask, is_eos.any(dim=1)


@torch.no_grad()
def generate(model, prompt_ids, prompt_mask, gen_cfg, tokenizer, synced: bool = False):
    """Sample responses for left-padded prompts; returns (B, T) ids with T <= max_new_tokens."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        do_sample=True,
        temperature=gen_cfg.temperature,
        top_k=gen_cfg.top_k,  # 0 = off; None would mean transformers' default of 50
        top_p=gen_cfg.top_p,
        max_new_tokens=gen_cfg.max_new_tokens,
        min_new_tokens=gen_cfg.min_new_tokens or None,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    out = model.generate(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        generation_config=config,
        synced_gpus=synced,
    )
    return out[:, prompt_ids.shape[1] :]


def pad_columns(x: torch.Tensor, width: int, value) -> torch.Tensor:
    """Right-pad (B, T) to (B, width) with `value`."""
    if x.shape[1] >= width:
        return x
    pad = torch.full((x.shape[0], width - x.shape[1]), value, dtype=x.dtype, device=x.device)
    return torch.cat([x, pad], dim=1)


@torch.no_grad()
def policy_logprobs(model, input_ids, attention_mask, response_ids, temperature: float):
    """Log-probs (B, T) and entropies (B, T) of `response_ids` under a causal LM."""
    T = response_ids.shape[1]
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from(attention_mask),
        logits_to_keep=T + 1,
    ).logits[:, :-1]
    logits = logits.float() / temperature
    return logprobs_from_logits(logits, response_ids), entropy_from_logits(logits)


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


def decode_responses(tokenizer, response_ids, response_mask, eos_id: int) -> list[str]:
    """Response texts without PAD and EOS."""
    keep = response_mask & (response_ids != eos_id)
    return [
        tokenizer.decode(row[m].tolist(), skip_special_tokens=True)
        for row, m in zip(response_ids, keep)
    ]


def scores_with_eos_penalty(raw_scores, finished, penalty: float | None) -> torch.Tensor:
    """Replace the score of responses that never emitted EOS by `penalty` (N+ study)."""
    if penalty is None:
        return raw_scores
    return torch.where(finished, raw_scores, torch.full_like(raw_scores, penalty))


def sequence_last_index(prompt_width: int, response_mask: torch.Tensor) -> torch.Tensor:
    """Position in the full (P+T) sequence of each response's last real token; (B,)."""
    return prompt_width + last_token_index(response_mask)


@dataclass
class RolloutModels:
    """What a rollout reads: the (possibly wrapped) actor-critic for scoring, a context
    yielding (actor module, synced flag) for generation, the frozen reference, the scorer."""

    actor_critic: torch.nn.Module
    generation_context: Callable
    reference: torch.nn.Module | None
    scorer: Scorer


@torch.no_grad()
def collect_rollout(
    models: RolloutModels, prompt_ids, prompt_mask, prompt_texts, cfg, tokenizer, timings=None
):
    """Generate and score one rank's prompts in rollout micro-batches -> RolloutBatch."""
    gen, micro = cfg.generation, cfg.ppo.rollout_micro_batch_size
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    chunks = [slice(i, i + micro) for i in range(0, prompt_ids.shape[0], micro)]
    start = time.perf_counter()
    with models.generation_context() as (actor, synced):
        responses = [
            generate(actor, prompt_ids[s], prompt_mask[s], gen, tokenizer, synced) for s in chunks
        ]
    generated = time.perf_counter()
    width = max(r.shape[1] for r in responses)
    response_ids = torch.cat([pad_columns(r, width, pad) for r in responses])
    response_ids, response_mask, finished = truncate_after_eos(response_ids, eos, pad)
    texts = decode_responses(tokenizer, response_ids, response_mask, eos)
    parts = [
        _score_chunk(
            models,
            prompt_ids[s],
            prompt_mask[s],
            response_ids[s],
            response_mask[s],
            prompt_texts[s],
            texts[s],
            gen.temperature,
        )
        for s in chunks
    ]
    merged = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    scores = scores_with_eos_penalty(merged["raw_scores"], finished, cfg.reward.missing_eos_penalty)
    if timings is not None:  # seconds spent generating, and scoring with the four models
        timings |= {"generate": generated - start, "score": time.perf_counter() - generated}
    batch = RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        scores=scores,
        finished=finished,
        **merged,
    )
    return batch, texts


def _score_chunk(
    models, prompt_ids, prompt_mask, response_ids, response_mask, prompts, texts, temperature
):
    """Old log-probs and values, reference log-probs and scores of one micro-batch."""
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, response_mask.long()], dim=1)
    T = response_ids.shape[1]
    logits, values = models.actor_critic(input_ids, attention_mask, T)
    logits = logits.float() / temperature
    old_logprobs = logprobs_from_logits(logits, response_ids)
    if models.reference is not None:
        ref_logprobs, _ = policy_logprobs(
            models.reference, input_ids, attention_mask, response_ids, temperature
        )
    else:
        ref_logprobs = old_logprobs.clone()
    last = sequence_last_index(prompt_ids.shape[1], response_mask)
    raw_scores = models.scorer(prompts, texts, input_ids, attention_mask, last)
    return {
        "old_logprobs": old_logprobs,
        "ref_logprobs": ref_logprobs.float(),
        "old_values": values.float(),
        "raw_scores": raw_scores.float(),
        "entropy": entropy_from_logits(logits),
    }


def describe_batch(tokenizer, batch: RolloutBatch, texts: list[str], rows: int = 2) -> str:
    """The first rows of a rollout, token by token with masks (debug.print_first_batch):
    what the model saw (prompt, attention) and what the losses use (response_mask)."""
    lines = [
        "== first rollout batch (token | prompt attention or response_mask | old logp | ref logp)"
    ]
    for b in range(min(rows, batch.response_ids.shape[0])):
        lines.append(
            f"-- row {b}: score {float(batch.scores[b]):.4g}, finished {bool(batch.finished[b])}: {texts[b]!r}"
        )
        for t, m in zip(batch.prompt_ids[b].tolist(), batch.prompt_mask[b].tolist()):
            lines.append(f"   P {tokenizer.convert_ids_to_tokens(t)!s:>14} | {m}")
        for t in range(batch.response_ids.shape[1]):
            token = tokenizer.convert_ids_to_tokens(int(batch.response_ids[b, t]))
            m = int(batch.response_mask[b, t])
            old, ref = float(batch.old_logprobs[b, t]), float(batch.ref_logprobs[b, t])
            lines.append(f"   R {token!s:>14} | {m} | {old:8.4f} | {ref:8.4f}")
    return "\n".join(lines)
