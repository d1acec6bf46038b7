"""The KV-cache decode loop: sample responses to left-padded prompts, then cut them
after the first stop token (`generate`, `truncate_after_eos`, `decode_responses`).

One prefill forward (each distinct prompt once with perf.shared_prompt_forward), then one
forward per token; positions count real tokens only, so a left-padded prompt continues
exactly as it would alone. Ranks that must stay in step (ZeRO-3 without gathered weights)
are kept so by a `keep_in_step` collective instead of transformers' synced_gpus.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from rlhf_dist.config import PerfConfig
from rlhf_dist.data.chat import is_stop
from rlhf_dist.data.vision import Media
from rlhf_dist.engine.cpu import decode_context
from rlhf_dist.engine.forward import (
    DEFAULT_PERF,
    cache_of,
    causal_lm,
    model_config,
    positions_of,
    prompt_cache,
    shares_prompts,
)
from rlhf_dist.engine.sampling import Sampling, Streams, sample_next

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# called once per decode step with whether this rank needs another forward; returns
# whether any rank does (ZeRO-3 without gathered weights: ranks forward in step)
KeepInStep = Callable[[bool], bool]


class StepWatch(Protocol):
    """What watches a decode loop between its steps: a served policy's partial rollouts
    (ppo.partial_rollouts, serving/partial.py), whose weights may change mid-response."""

    def sampled(self, logits: torch.Tensor, token: torch.Tensor) -> None:
        """Each step: the logits (B, V) the token (B,) was drawn from."""
        ...

    def swapped(self, tokens: int) -> bool:
        """Before the forward after `tokens` sampled tokens: whether the model's weights
        changed since the last forward (the loop then recomputes its KV cache)."""
        ...


def truncate_after_eos(
    response_ids: torch.Tensor, stop_ids: int | Sequence[int], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, response_mask, finished): ids and mask (B, T), finished (B,) bool; mask True
    up to and including the first stop token (any of `stop_ids`, an id or a sequence;
    "EOS" below).

    response_ids: (B, T). Tokens after the first EOS become PAD (generate may already
    pad them); rows without EOS keep all T tokens and have finished=False.
    """
    is_eos = is_stop(response_ids, stop_ids)
    # Number of EOS strictly before t: 0 means t is at or before the first EOS.
    eos_before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()
    mask = eos_before == 0
    ids = torch.where(mask, response_ids, torch.full_like(response_ids, pad_id))
    return ids, mask, is_eos.any(dim=1)


def cut_before(
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    finished: torch.Tensor,
    token_id: int,
    pad_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`truncate_after_eos`'s (ids, response_mask, finished), each response cut before the
    first `token_id` it holds (PAD from there, mask False, not finished): a vision model's
    image token (data/vision.py RowMedia) in a response would ask every later forward for
    an image the prompt does not have. Shapes (B, T), (B, T), (B,)."""
    hit = (response_ids == token_id) & response_mask
    after = torch.cumsum(hit.long(), dim=1) > 0
    ids = torch.where(after, torch.full_like(response_ids, pad_id), response_ids)
    return ids, response_mask & ~after, finished & ~hit.any(dim=1)


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    gen_cfg: Sampling,
    tokenizer: PreTrainedTokenizerBase,
    keep_in_step: KeepInStep | None = None,
    stop_ids: int | Sequence[int] | None = None,
    perf: PerfConfig = DEFAULT_PERF,
    streams: Streams | None = None,
    media: Media | None = None,
    watch: StepWatch | None = None,
) -> torch.Tensor:
    """Sample responses for left-padded prompts (B, P): (B, T) ids, T <= max_new_tokens,
    PAD after a row's first stop token (any of `stop_ids`; None: the tokenizer's EOS);
    T is shorter only when every row has finished.

    A plain KV-cache decode loop: one prefill forward, then one forward per token, without
    transformers' `generate` layers per token (logits processors, stopping criteria,
    input preparation), which cost a small policy much of its time outside the model.
    Positions count real tokens only, as in scoring, so a left-padded
    prompt is continued exactly as it would be on its own.
    keep_in_step (ZeRO-3 without gathered weights, where every forward gathers layers
    with collectives): called once per step with whether this rank needs another
    forward, it returns whether any rank does; a finished rank then runs throw-away
    forwards until all ranks are done, so none waits forever for the others.
    perf: its speed paths (perf.shared_prompt_forward for the prefill; on CPU
    perf.packed_linears and perf.grouped_kv_attention, engine/cpu.py `decode_context`).
    streams: [(torch.Generator, n)] over the rows in order, their draws
    (sampling.sample_categorical); None: the global RNG.
    media: a vision-language model's pixel inputs of the prompts' images
    (data/vision.py), taken by the prefill (`forward.prefill_inputs`); the image features
    are then in the KV cache and each decode step feeds one token. A row that samples
    the model's image token (`_image_token`) ends there and the token is never fed (PAD
    in its place): the prompt has no image for it; the rollout then cuts the response
    before it (`cut_before`).
    watch: sees each step's logits and token, and says between steps whether the weights
    changed (a served partial rollout, `StepWatch`); the KV cache of the prompt and the
    tokens so far is then recomputed under the new weights (`_step`).
    """
    pad = tokenizer.pad_token_id
    stops = (tokenizer.eos_token_id,) if stop_ids is None else stop_ids
    eos = torch.as_tensor(stops, dtype=torch.long, device=prompt_ids.device).reshape(-1)
    mask = prompt_mask.long()
    with decode_context(model, prompt_ids.shape[0], perf):
        logits, cache = _prefill(model, prompt_ids, mask, _shares_prompts(model, perf), media)
        start = _last_positions(model, prompt_ids, mask, media)
        image = _image_token(model)
        return _decode(
            model, logits, cache, (prompt_ids, mask, media), start, gen_cfg, keep_in_step, eos,
            pad, streams, watch, image,
        )  # fmt: skip


def _image_token(model: nn.Module) -> int | None:
    """The id of the token a vision-language model fills with image features (LLaVA's
    <image>, Qwen2-VL's <|image_pad|>: config.image_token_id), None for a text model."""
    config = model_config(model)
    if getattr(config, "vision_config", None) is None:
        return None
    image = getattr(config, "image_token_id", None)
    return None if image is None else int(image)


def _last_positions(
    model: nn.Module, prompt_ids: torch.Tensor, mask: torch.Tensor, media: Media | None
) -> torch.Tensor:
    """The prompts' last position ids: (B, 1), or (3, B, 1) for an M-RoPE model (its
    three axes equal there: a prompt ends in text). Each decoded token is text, one more
    on every axis (Qwen2-VL, arXiv:2409.12191 section 2.1)."""
    return positions_of(model_config(model), prompt_ids, mask, media)[..., -1:]


def _decode(
    model: nn.Module,
    logits: torch.Tensor,
    cache: dict[str, Any],
    prompt: tuple[torch.Tensor, torch.Tensor, Media | None],
    position: torch.Tensor,
    gen_cfg: Sampling,
    keep_in_step: KeepInStep | None,
    eos: torch.Tensor,
    pad: int,
    streams: Streams | None = None,
    watch: StepWatch | None = None,
    image: int | None = None,
) -> torch.Tensor:
    """`generate`'s loop from the prefill's last logits (B, V), KV cache, prompt (ids, mask
    (B, P), pixel inputs or None) and last positions (`_last_positions`): (B, T) sampled
    ids, PAD after a row's stop token or its `image` token (`_image_token`, never fed);
    eos: (S,) stop ids."""
    prompt_ids, mask, media = prompt
    finished = torch.zeros(mask.shape[0], dtype=torch.bool, device=mask.device)
    steps, more = gen_cfg.max_new_tokens, True  # more: this rank still samples
    tokens: list[torch.Tensor] = []
    while True:
        if more:
            allow_eos = len(tokens) >= gen_cfg.min_new_tokens
            token = sample_next(logits, gen_cfg, eos, allow_eos, streams)
            if watch is not None:
                watch.sampled(logits, token)
            tokens.append(torch.where(finished, pad, token))
            finished |= is_stop(tokens[-1], eos)
            if image is not None:
                finished |= tokens[-1] == image
            more = len(tokens) < steps and not bool(finished.all())
        if not (more if keep_in_step is None else keep_in_step(more)):
            return torch.stack(tokens, dim=1)
        feed = tokens[-1] if more else torch.full_like(tokens[-1], pad)  # throw-away forward
        if image is not None:  # its row has ended: the prompt has no image for it
            feed = torch.where(feed == image, pad, feed)
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        position = position + 1
        if watch is not None and more and watch.swapped(len(tokens)):
            # new weights at this step boundary: the old KV cache would mix them with the
            # old ones, so the prompt and every token so far are run again (a new cache)
            # (a prefill: the images and M-RoPE positions too; a sampled image token, never
            # fed, is PAD there as in `feed`)
            sofar = torch.stack(tokens, dim=1)
            if image is not None:
                sofar = torch.where(sofar == image, pad, sofar)
            sofar = torch.cat([prompt_ids, sofar], dim=1)
            out = prompt_cache(model, sofar, mask, False, media)[0]
        else:
            out = _step(model, feed[:, None], mask, position, cache)
        logits, cache = out.logits[:, -1], cache_of(out)


def _step(
    model: nn.Module,
    ids: torch.Tensor,
    mask: torch.Tensor,
    position: torch.Tensor,
    cache: dict[str, Any],
) -> Any:
    """One decode forward of ids (B, S) at positions (B, S) after `cache` (empty: none),
    attention mask (B, cached + S)."""
    return model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=position,
        use_cache=True,
        **cache,
    )


def _prefill(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    mask: torch.Tensor,
    share: bool,
    media: Media | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The prefill forward of left-padded prompts (B, P): the last position's logits
    (B, V) and the KV cache (`cache_of`). With `share` each distinct prompt runs once
    and its cache and logits are indexed out to its rows (algo/prefix.py): GRPO's n
    samples of a prompt cost one prompt forward, not n."""
    out, cache, inverse = prompt_cache(model, prompt_ids, mask, share, media)
    logits = out.logits[:, -1]
    return (logits, cache) if inverse is None else (logits.index_select(0, inverse), cache)


def _shares_prompts(model: nn.Module, perf: PerfConfig) -> bool:
    """forward.shares_prompts of the transformers model inside `model`; a model that is
    not a transformers one never shares."""
    try:
        return shares_prompts(causal_lm(model), perf)
    except TypeError:
        return False


def pad_columns(x: torch.Tensor, width: int, value: float) -> torch.Tensor:
    """Right-pad (B, T) to (B, width) with `value`."""
    if x.shape[1] >= width:
        return x
    pad = torch.full((x.shape[0], width - x.shape[1]), value, dtype=x.dtype, device=x.device)
    return torch.cat([x, pad], dim=1)


def decode_responses(
    tokenizer: PreTrainedTokenizerBase,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    stop_ids: int | Sequence[int],
) -> list[str]:
    """Response texts, one per row of response_ids and response_mask (B, T), without PAD
    and stop tokens (an id or a sequence of ids)."""
    keep = response_mask & ~is_stop(response_ids, stop_ids)
    return [
        tokenizer.decode(row[m].tolist(), skip_special_tokens=True)
        for row, m in zip(response_ids, keep)
    ]
