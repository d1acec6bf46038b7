"""Padding-free packed rows: where each real token of a padded batch goes when the rows'
real tokens are laid end to end (perf.packed_sequences, docs/architecture.md section 10).

A padded batch (B, L) pays attention and MLP compute for every padding position. Packing
places each row's real tokens (contiguous: left-padded prompt + response + right
padding) into bins of at most `capacity` tokens, first-fit decreasing (Johnson 1973;
at most 11/9 OPT + 6/9 bins, Dosa 2007), so a packed row is never longer than the
padded row was and the attention cost per row does not grow. Position ids restart at 0
for each sequence, so a model that reads sequence boundaries from them (transformers'
masking_utils: a block-diagonal causal mask; flash attention: its varlen kernels)
attends within each sequence only, and each real token gets the same position it had
in the padded batch.
"""

from __future__ import annotations

import torch


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of item indices: items longest first (ties by index), each into the first
    bin with room for it, else a new bin; items of length 0 are left out.

    lengths: item sizes; capacity: a bin's size. An item longer than `capacity` gets a
    bin of its own. Returns the bins in the order they were opened, each listing its
    items in the order they were placed.
    """
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        if n <= 0:
            continue
        b = next((b for b, r in enumerate(room) if n <= r), None)
        if b is None:
            bins.append([i])
            room.append(capacity - n)
        else:
            bins[b].append(i)
            room[b] -= n
    return bins


def packed_layout(
    attention_mask: torch.Tensor, capacity: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The packed layout of a padded batch.

    attention_mask: (B, L), 1/True on real tokens, each row's real tokens contiguous (a
    ValueError otherwise); capacity: the longest packed row allowed (L keeps rows no
    longer than they were; the total token count packs everything into one row).

    Returns, with R packed rows of width W (the fullest bin) and flat indices
    (b * L + l into the padded batch, r * W + w into the packed one):
    - gather (R, W) long: the padded flat index of the token at each packed slot, -1 at
      the padding that ends a packed row;
    - scatter (B, L) long: the packed flat index of each real token, -1 at padding;
    - position_ids (R, W) long: each token's index within its sequence (the padded
      batch's mask cumsum - 1 at the same token); a packed row's closing padding counts
      from 0 as one more sequence, so it never joins the last real one.
    A batch with no real token gives R = 0.
    """
    mask = attention_mask.bool()
    B, L = mask.shape
    cols = torch.arange(L, device=mask.device)
    lengths = mask.sum(1)
    first = torch.where(mask, cols, L).min(1).values  # L for a row without real tokens
    last = torch.where(mask, cols, -1).max(1).values
    gaps = (lengths > 0) & (last - first + 1 != lengths)
    sizes, gapped = torch.stack([lengths, gaps.long()]).tolist()  # one host sync
    if any(gapped):
        rows = [i for i, g in enumerate(gapped) if g]
        raise ValueError(
            f"packed sequences need each row's real tokens contiguous; rows {rows} have "
            "padding between real tokens"
        )
    bins = first_fit_decreasing(sizes, capacity)
    fills = [sum(sizes[i] for i in b) for b in bins]
    R, W = len(bins), max(fills, default=0)
    row_of, offset = [0] * B, [0] * B
    for r, members in enumerate(bins):
        at = 0
        for i in members:
            row_of[i], offset[i], at = r, at, at + sizes[i]
    start = torch.tensor(row_of, device=mask.device) * W + torch.tensor(offset, device=mask.device)
    within = cols - first[:, None]  # index within the sequence at real tokens
    scatter = torch.where(mask, start[:, None] + within, -1)
    gather = torch.full((R * W,), -1, dtype=torch.long, device=mask.device)
    gather[scatter[mask]] = mask.flatten().nonzero().flatten()
    slot = torch.arange(W, device=mask.device)
    fill = torch.tensor(fills, dtype=torch.long, device=mask.device).reshape(R, 1)
    position_ids = (slot - fill).expand(R, W).clone()  # padding: 0, 1, ... after the fill
    position_ids.view(-1)[scatter[mask]] = within[mask]
    return gather.reshape(R, W), scatter, position_ids


def pack_tokens(x: torch.Tensor, gather: torch.Tensor) -> torch.Tensor:
    """x (B, L, ...) laid out as packed rows (R, W, ...) by `gather` (packed_layout's);
    padding slots take x's first entry (any value: their outputs are never read)."""
    flat = x.reshape(-1, *x.shape[2:])
    return flat[gather.clamp(min=0)]


def unpack_tokens(packed: torch.Tensor, scatter: torch.Tensor) -> torch.Tensor:
    """Packed rows (R, W, ...) back to the padded layout (B, L, ...) by `scatter`
    (packed_layout's), 0 at padding. Differentiable: a gather, no in-place write."""
    flat = packed.reshape(-1, *packed.shape[2:])
    if flat.shape[0] == 0:  # no real token anywhere
        return packed.new_zeros(*scatter.shape, *packed.shape[2:])
    out = flat[scatter.clamp(min=0)]
    real = (scatter >= 0).reshape(*scatter.shape, *([1] * (packed.dim() - 2)))
    return torch.where(real, out, torch.zeros((), dtype=out.dtype, device=out.device))
