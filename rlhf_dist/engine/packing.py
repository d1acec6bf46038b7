"""Padding-free packed rows for whole-sequence forwards (perf.packed_sequences): where
each real token of a padded batch goes in packed rows, the forward's inputs, and the
check that a backbone can take them. Positions always count real tokens only.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from rlhf_dist.algo.packing import pack_tokens, packed_layout
from rlhf_dist.errors import ConfigError

# (gather, scatter, position_ids) of packed rows: algo.packing.packed_layout's.
Layout = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def packing_layout(lm: nn.Module, attention_mask: torch.Tensor, packed: bool) -> Layout | None:
    """`algo.packing.packed_layout` of a batch for transformers model `lm` when `packed`
    (perf.packed_sequences; `check_packable` refuses a backbone that cannot take packed
    rows), else None (also when no row has a real token).

    Flash attention gets everything in ONE row: transformers reads sequence starts from
    position ids only in a batch of one (modeling_flash_attention_utils
    `_is_packed_sequence`) and runs its varlen kernels, whose cost stays per sequence.
    Every other implementation (eager, sdpa) gets bins of the padded width L: with no
    attention mask, masking_utils finds the sequences from the position ids
    (`find_packed_sequence_indices`) and builds a block-diagonal causal mask, whose cost
    grows with the row's length squared, so no packed row is longer than the padded one.
    """
    if not packed:
        return None
    check_packable(lm)
    B, L = attention_mask.shape
    flash = "flash" in str(getattr(lm.config, "_attn_implementation", None) or "")
    layout = packed_layout(attention_mask, B * L if flash else L)
    return None if layout[0].shape[0] == 0 else layout


def backbone_inputs(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, layout: Layout | None
) -> dict[str, torch.Tensor | None]:
    """A whole-sequence forward's inputs: padded, positions counting real tokens; or
    packed by `layout` (packing_layout's), no attention mask, positions per sequence."""
    if layout is None:
        position_ids = position_ids_from(attention_mask)
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
        }
    gather, _, position_ids = layout
    return {
        "input_ids": pack_tokens(input_ids, gather),
        "attention_mask": None,
        "position_ids": position_ids,
    }


def check_packable(lm: nn.Module) -> None:
    """Refuse perf.packed_sequences for transformers model `lm` unless its backbone builds
    its masks with transformers' masking_utils (Llama, Qwen2/3, Mistral, Gemma, GPT-2,
    ...): only there does a forward without an attention mask keep attention inside each
    sequence the position ids delimit. Checked once per backbone class."""
    backbone = getattr(lm, lm.base_model_prefix)
    kind = type(backbone)
    if kind in _PACKABLE:
        return
    from transformers import masking_utils

    module = sys.modules.get(kind.__module__)
    names = ("create_causal_mask", "create_sliding_window_causal_mask")
    if not any(getattr(module, n, None) is getattr(masking_utils, n) for n in names):
        raise ConfigError(
            f"perf.packed_sequences: {kind.__name__} does not build its attention masks with "
            "transformers' masking_utils, so packed rows would attend across sequences; set "
            "perf.packed_sequences=false"
        )
    _PACKABLE.add(kind)


_PACKABLE: set[type] = set()  # backbone classes check_packable accepted


def position_ids_from(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counting real tokens only, so left padding does not shift them; (B, L)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
