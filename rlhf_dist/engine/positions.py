"""Multimodal rotary positions (M-RoPE) of Qwen2-VL / Qwen2.5-VL for our own forwards and
decode loop (docs/vision.md, "M-RoPE positions").

Qwen2-VL (Wang et al. 2024, arXiv:2409.12191, section 2.1) rotates each head's dimensions in
three sections by three position ids: temporal, height and width. A text token has the same id
on all three axes, one more than the previous token's largest id. An image of merged grid
(t, h, w) = (grid_t, grid_h / m, grid_w / m) (m the vision tower's spatial merge) takes
t * h * w tokens; its token (k, i, j) has ids (s + k, s + i, s + j), s being the id the next
text token would have had, and the text after it resumes at s + max(h, w) (transformers'
`get_rope_index`, images only: the temporal step of videos is not needed here).

A prompt of n real tokens thus ends at id n - 1 + delta, with delta = max id + 1 - n <= 0
(`rope_deltas`); every later token, decoded or teacher-forced, is text: the k-th real token of
the whole sequence (0-based) has id k + delta on all three axes. Left padding: pads get id 0
and real tokens are counted from the first real one, so a padded row continues as alone.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn


def _image_ids(start: int, grid: Tensor, merge: int) -> Tensor:
    """(3, t*h*w) ids of one image's tokens from `start`: grid (3,) = (t, H, W) patches."""
    t, h, w = int(grid[0]), int(grid[1]) // merge, int(grid[2]) // merge
    axes = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack(axes).reshape(3, -1) + start


def _row_ids(ids: list[int], image_token_id: int, grids: Iterator[Tensor], merge: int) -> Tensor:
    """(3, L) ids of one row's L real tokens; consumes one grid per image it holds."""
    chunks, start, i = [], 0, 0
    while i < len(ids):
        if ids[i] != image_token_id:
            j = ids.index(image_token_id, i) if image_token_id in ids[i:] else len(ids)
            chunks.append(torch.arange(start, start + j - i).expand(3, -1))
            start, i = start + j - i, j
            continue
        grid = next(grids, None)
        if grid is None:
            raise ValueError("more image tokens in input_ids than images in image_grid_thw")
        block = _image_ids(start, grid, merge)
        n = block.shape[1]
        if ids[i : i + n] != [image_token_id] * n:
            raise ValueError(f"an image of grid {grid.tolist()} needs {n} image tokens in a row")
        chunks.append(block)
        start, i = start + max(int(grid[1]), int(grid[2])) // merge, i + n
    return torch.cat(chunks, dim=1) if chunks else torch.zeros(3, 0, dtype=torch.long)


def mrope_positions(
    input_ids: Tensor,
    attention_mask: Tensor,
    image_grid_thw: Tensor | None,
    image_token_id: int,
    spatial_merge_size: int,
) -> tuple[Tensor, Tensor]:
    """M-RoPE ids of left-padded prompts.

    input_ids (B, P), attention_mask (B, P) 1 on real tokens; image_grid_thw (N, 3) the
    (t, H, W) patch grid of each image, in the order the images' tokens appear row by row (the
    processor's order); None when no row holds an image. Returns position_ids (3, B, P) long,
    0 on pads, and rope_deltas (B, 1) long (the module docstring). Raises ValueError when the
    image tokens and the grids disagree.
    """
    grids = iter(
        image_grid_thw if image_grid_thw is not None else torch.zeros(0, 3, dtype=torch.long)
    )
    positions = torch.zeros(3, *input_ids.shape, dtype=torch.long)
    deltas = torch.zeros(input_ids.shape[0], 1, dtype=torch.long)
    for row in range(input_ids.shape[0]):
        real = attention_mask[row].bool().cpu()
        ids = _row_ids(
            input_ids[row].cpu()[real].tolist(), image_token_id, grids, spatial_merge_size
        )
        positions[:, row, real] = ids
        if ids.shape[1]:
            deltas[row, 0] = int(ids.max()) + 1 - ids.shape[1]
    if next(grids, None) is not None:
        raise ValueError("more images in image_grid_thw than image tokens in input_ids")
    return positions.to(input_ids.device), deltas.to(input_ids.device)


def mrope_next_positions(attention_mask: Tensor, rope_deltas: Tensor) -> Tensor:
    """The decode step's ids: attention_mask (B, S) over every token so far, the one being
    fed included (1 on real tokens); rope_deltas (B, 1). Returns position_ids (3, B, 1)."""
    text = attention_mask.long().sum(dim=-1, keepdim=True) - 1  # (B, 1) index among real tokens
    return (text + rope_deltas).unsqueeze(0).expand(3, -1, -1)


def mrope_extend(
    prompt_positions: Tensor, prompt_mask: Tensor, rope_deltas: Tensor, length: int
) -> Tensor:
    """Ids of prompt + `length` teacher-forced response tokens, for one full forward:
    prompt_positions (3, B, P), prompt_mask (B, P), rope_deltas (B, 1) -> (3, B, P + length)."""
    real = prompt_mask.long().sum(dim=-1, keepdim=True)  # (B, 1)
    steps = torch.arange(length, device=prompt_mask.device)  # (R,)
    response = (real + rope_deltas + steps).unsqueeze(0).expand(3, -1, -1)  # (3, B, R)
    return torch.cat([prompt_positions, response], dim=-1)


def mrope_ids_of(config: Any) -> tuple[int, int]:
    """(image_token_id, spatial_merge_size) of a Qwen2-VL / Qwen2.5-VL model config."""
    return int(config.image_token_id), int(config.vision_config.spatial_merge_size)


def is_mrope(config: Any) -> bool:
    """Whether a transformers model config rotates by M-RoPE (its text config's rope
    parameters carry an `mrope_section`: Qwen2-VL, Qwen2.5-VL)."""
    text = getattr(config, "text_config", config)
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    return "mrope_section" in rope


def _token_logprobs(logits: Tensor, ids: Tensor) -> Tensor:
    """logits (B, L, V), ids (B, L) -> (B, L) fp32 log-probs of ids."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def cached_mrope_logprobs(
    model: nn.Module, inputs: Mapping[str, Tensor], response_ids: Tensor
) -> Tensor:
    """Teacher-forced log-probs of response_ids (B, R) after the prompts in `inputs` (processor
    outputs: input_ids (B, P) left-padded, attention_mask (B, P), and pixel_values (patches, D)
    + image_grid_thw (N, 3) when images are present): one prefill with `mrope_positions`, then
    R - 1 single-token steps on the KV cache with `mrope_next_positions`. Returns (B, R) fp32,
    what our decode loop's sampler log-probs are for a Qwen-VL policy."""
    image_token_id, merge = mrope_ids_of(model.config)
    mask = inputs["attention_mask"]
    grid = inputs.get("image_grid_thw")
    positions, deltas = mrope_positions(inputs["input_ids"], mask, grid, image_token_id, merge)
    vision = {k: inputs[k] for k in ("pixel_values", "image_grid_thw") if k in inputs}
    out = model(
        input_ids=inputs["input_ids"],
        attention_mask=mask,
        position_ids=positions,
        use_cache=True,
        **vision,
    )
    logprobs = [_token_logprobs(out.logits[:, -1:], response_ids[:, :1])]
    cache = out.past_key_values
    for step in range(1, response_ids.shape[1]):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        token = response_ids[:, step - 1 : step]
        position = mrope_next_positions(mask, deltas)
        out = model(
            input_ids=token,
            attention_mask=mask,
            position_ids=position,
            past_key_values=cache,
            use_cache=True,
        )
        cache = out.past_key_values
        logprobs.append(_token_logprobs(out.logits[:, -1:], response_ids[:, step : step + 1]))
    return torch.cat(logprobs, dim=1)
