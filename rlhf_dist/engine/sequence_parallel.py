"""The sequence-parallel token forward (distributed.sequence_parallel_size; DeepSpeed-Ulysses,
Jacobs et al. 2023, arXiv:2309.14509): `token_forward` of one pooled micro-batch with
each rank of the group running 1/n of the columns, and the attention function that
exchanges heads for positions around attention (docs/distributed.md "Sequence
parallelism").

Every rank of the group holds the same rows. The labels are shifted on the WHOLE row
before it is cut (the last position of slice r predicts the first token of slice r+1);
positions are the row's own (RoPE needs global offsets), packed rows keep theirs; the
attention mask is built once for the whole row, (R, 1, W, W) bool, and handed to the
model as a 4-D mask, which transformers' masking_utils passes through unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rlhf_dist.algo.packing import pack_tokens, unpack_tokens
from rlhf_dist.config import PerfConfig
from rlhf_dist.distributed.sequence_parallel import (
    SequenceGroup,
    active_group,
    gather_columns,
    gather_heads,
    scatter_heads,
    sequence_parallel,
)
from rlhf_dist.engine import packing
from rlhf_dist.errors import ConfigError
from rlhf_dist.planning.start import check_sequence_parallel_heads

ATTENTION = "rlhf_dist_ulysses"  # the name registered in transformers' AttentionInterface
KEY = "distributed.sequence_parallel_size"
# engine.forward.head_logprobs(lm, hidden (N, H), tokens (N,), temperature, chunk_tokens,
# with_entropy) -> (log-probs (N,), entropies (N,) or None), passed in: engine.forward
# imports this module.
HeadLogprobs = Callable[
    [nn.Module, torch.Tensor, torch.Tensor, float, int, bool],
    tuple[torch.Tensor, torch.Tensor | None],
]


def ulysses_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function (AttentionInterface) under `sequence_parallel`:
    query (B, h, S, d), key/value (B, h_kv, S, d) of this rank's S = W/n positions, already
    rotated; attention_mask (B, 1, W, W) bool, True = may attend (`_row_mask`), or None:
    causal over the whole row (right-padded rows, `_starts_real`). Heads for
    positions (all-to-all), sdpa over the whole row for h/n heads, positions back.
    Returns (B, S, h, d) as transformers' sdpa_attention_forward does, and no weights."""
    sg = active_group()
    if sg is None:
        raise RuntimeError(f"{ATTENTION} attention runs only inside a sequence-parallel forward")
    for name in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise ConfigError(f"{KEY}: attention with {name} is not supported; set it to 1")
    if key.shape[1] % sg.size:
        # Fewer KV heads than ranks (MQA, the demo's 1): each query head's KV copy, so
        # every rank receives the KV heads of its query heads (DeepSpeed replicates alike).
        repeat = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1)
    q, k, v = (scatter_heads(x, sg) for x in (query, key, value))
    # GQA: local query head j uses local KV head j // groups (both blocks are contiguous),
    # which sdpa's enable_gqa does without keeping expanded copies for backward.
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=attention_mask is None,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return gather_heads(out, sg).transpose(1, 2).contiguous(), None


# The config of the model whose attention `ulysses_attention_on` switched, inside it.
_SWITCHED: contextvars.ContextVar[object | None] = contextvars.ContextVar(
    "rlhf_dist_ulysses_config", default=None
)


@contextlib.contextmanager
def ulysses_attention_on(lm: nn.Module) -> Iterator[None]:
    """Transformers model `lm` attends through `ulysses_attention` inside; its own
    implementation again afterwards (generation never sees the exchange)."""
    from transformers import AttentionInterface

    if ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION, ulysses_attention)
    with _attention_switched(lm.config):
        yield


@contextlib.contextmanager
def _attention_switched(config: Any) -> Iterator[None]:
    """The model of `config` attends through ulysses_attention inside (its config names
    the implementation transformers looks up on every forward)."""
    before = config._attn_implementation
    config._attn_implementation = ATTENTION
    token = _SWITCHED.set(config)
    try:
        yield
    finally:
        _SWITCHED.reset(token)
        config._attn_implementation = before


def checkpoint_contexts() -> tuple[
    contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]
]:
    """`context_fn` of torch.utils.checkpoint (non-reentrant; models/loading.py): gradient
    checkpointing recomputes a layer's forward during backward, after `sequence_parallel`
    and `ulysses_attention_on` have exited, so the recomputation would attend over this
    rank's slice alone (a shape error at best). Called at the layer's forward, this puts
    the group and the attention of that forward back around its recomputation; outside
    sequence parallelism both contexts do nothing. The group's ranks recompute in the
    same backward order, so the exchanges stay paired."""
    group, config = active_group(), _SWITCHED.get()
    if group is None or config is None:
        return contextlib.nullcontext(), contextlib.nullcontext()
    return contextlib.nullcontext(), _recompute_under(group, config)


@contextlib.contextmanager
def _recompute_under(group: SequenceGroup, config: Any) -> Iterator[None]:
    with sequence_parallel(group), _attention_switched(config):
        yield


def check_heads(config: Any, size: int) -> None:
    """The loaded model's attention heads against the group size (planning's check, the
    one line naming the key). Key/value heads that it does not divide are copied per
    query head first (`ulysses_attention`)."""
    check_sequence_parallel_heads(size, getattr(config, "num_attention_heads", None))


@dataclass(frozen=True)
class SequenceRows:
    """One pooled micro-batch laid out for the split, every tensor (R, W) with W a
    multiple of the group size: ids, positions, `scored` (bool: the position's next token
    is scored), `targets` (that next token); `mask` (R, 1, W, W) bool, or None where
    causal alone is exact (`_starts_real`); `width` the row width before the columns
    that make it a multiple; `scatter` (packed rows back to the padded batch,
    packing_layout's) or None."""

    ids: torch.Tensor
    positions: torch.Tensor
    scored: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor | None
    width: int
    scatter: torch.Tensor | None


def sequence_rows(
    lm: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    predict_mask: torch.Tensor,
    perf: PerfConfig,
    n: int,
) -> SequenceRows:
    """`SequenceRows` of a batch (B, L) whose last T = predict_mask.shape[1] tokens are
    scored (token_forward's arguments): padded, or packed with perf.packed_sequences."""
    B, L = input_ids.shape
    T = predict_mask.shape[1]
    # Shift on the whole row: position p predicts token p + 1.
    scored = torch.zeros(B, L, dtype=torch.bool, device=input_ids.device)
    scored[:, L - 1 - T : L - 1] = predict_mask
    targets = torch.zeros_like(input_ids)
    targets[:, : L - 1] = input_ids[:, 1:]
    layout = packing.packing_layout(lm, attention_mask, perf.packed_sequences)
    if layout is None:
        ids, positions, scatter = input_ids, packing.position_ids_from(attention_mask), None
        key_real = attention_mask.bool()
    else:
        gather, scatter, positions = layout
        real = gather >= 0  # the closing padding of a packed row is not a token
        ids = pack_tokens(input_ids, gather)
        scored = pack_tokens(scored, gather) & real
        targets = pack_tokens(targets, gather)
        key_real = None
    width = ids.shape[1]
    pad = -width % n  # columns that make the width a multiple of n
    if pad:
        ids, scored, targets = (F.pad(x, (0, pad)) for x in (ids, scored, targets))
        tail = torch.arange(pad, device=ids.device).expand(ids.shape[0], pad)
        positions = torch.cat([positions, tail], dim=1)  # packed: one more sequence
        if key_real is not None:
            key_real = F.pad(key_real, (0, pad))
    mask = (
        None if key_real is not None and _starts_real(key_real) else _row_mask(positions, key_real)
    )
    return SequenceRows(ids, positions, scored, targets, mask, width, scatter)


def _starts_real(key_real: torch.Tensor) -> bool:
    """Whether every padded row's real tokens come first (right padding only): then the
    causal mask alone is exact for every real query, and sdpa needs no (W, W) mask, which
    its CPU and GPU kernels would otherwise expand to floats on every call."""
    return bool((key_real[:, :-1] >= key_real[:, 1:]).all()) and bool(key_real[:, 0].all())


def _row_mask(positions: torch.Tensor, key_real: torch.Tensor | None) -> torch.Tensor:
    """(R, 1, W, W) bool attention mask of whole rows: causal, and within the padded row's
    real tokens (key_real (R, W)) or, packed (key_real None), within the sequence the
    positions delimit (a new one where a position is 0). The diagonal always: a padding
    query with no key would make sdpa's softmax NaN, and NaN times a zero gradient is NaN."""
    W = positions.shape[1]
    cols = torch.arange(W, device=positions.device)
    causal = cols[None, :] <= cols[:, None]  # (query, key)
    if key_real is not None:
        allowed = causal[None] & key_real[:, None, :]
    else:
        seq = (positions == 0).long().cumsum(1)
        allowed = causal[None] & (seq[:, :, None] == seq[:, None, :])
    return (allowed | torch.eye(W, dtype=torch.bool, device=positions.device))[:, None]


def sequence_parallel_logprobs(
    model: nn.Module,
    lm: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    predict_mask: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    perf: PerfConfig,
    sg: SequenceGroup,
    head_logprobs: HeadLogprobs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """token_forward's (log-probs (B, T), entropies (B, T) or None) of a pooled
    micro-batch, this rank running columns [r*S, (r+1)*S) of every row; the same tensors,
    with gradient, on every rank of the group. head_logprobs: engine.forward's."""
    check_heads(lm.config, sg.size)
    rows = sequence_rows(lm, input_ids, attention_mask, predict_mask, perf, sg.size)
    S = rows.ids.shape[1] // sg.size
    cols = slice(sg.rank * S, (sg.rank + 1) * S)
    hidden = _slice_hidden(model, lm, rows, cols)  # (R, S, H)
    selected = rows.scored[:, cols]
    anchor = not bool(selected.any())
    if anchor:
        # No scored token in this slice: score one position times 0, so this rank's
        # backward still reaches the head (DDP and ZeRO-3 expect every gradient).
        selected = torch.zeros_like(selected)
        selected[0, 0] = True
    lp, entropy = head_logprobs(
        lm,
        hidden[selected],
        rows.targets[:, cols][selected],
        temperature,
        perf.logprob_chunk_tokens,
        with_entropy,
    )
    outs: list[torch.Tensor | None] = []
    for values in (lp, entropy):
        if values is None:
            outs.append(None)
            continue
        values = values * 0.0 if anchor else values
        local = torch.zeros(selected.shape, dtype=values.dtype, device=values.device)
        whole = gather_columns(local.masked_scatter(selected, values), sg)  # (R, W)
        outs.append(_padded_columns(whole, rows, input_ids.shape[1], predict_mask))
    return outs[0], outs[1]


def _slice_hidden(model: nn.Module, lm: nn.Module, rows: SequenceRows, cols: slice) -> torch.Tensor:
    """The backbone's last hidden states (R, S, H) of columns `cols` of the rows, from a
    forward of `model` itself (engine.forward.final_hidden_states' hook)."""
    seen: list[torch.Tensor] = []
    backbone = getattr(lm, lm.base_model_prefix)
    handle = backbone.register_forward_hook(
        lambda module, args, output: seen.append(
            output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        )
    )
    try:
        with ulysses_attention_on(lm):
            model(
                input_ids=rows.ids[:, cols],
                attention_mask=rows.mask,
                position_ids=rows.positions[:, cols],
                logits_to_keep=1,
                use_cache=False,
            )
    finally:
        handle.remove()
    return seen[-1]


def _padded_columns(
    whole: torch.Tensor, rows: SequenceRows, L: int, predict_mask: torch.Tensor
) -> torch.Tensor:
    """Per-position values (R, W) of the rows -> (B, T) at the positions that predict the
    last T tokens of the padded batch (B, L); 0 outside predict_mask (never scored)."""
    T = predict_mask.shape[1]
    whole = whole[:, : rows.width]
    padded = whole if rows.scatter is None else unpack_tokens(whole, rows.scatter)
    return padded[:, L - 1 - T : L - 1]
