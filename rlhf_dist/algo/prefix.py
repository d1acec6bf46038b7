"""Shared prompt prefixes: a group of rows that start with the same prompt needs that
prompt's forward once (perf.shared_prompt_forward, docs/architecture.md section 10).

GRPO, RLOO and every group estimator sample n responses per prompt, so a rollout of B
rows holds only B / n distinct prompts. Generation's prefill, rollout scoring and the
PPO update each run the prompt tokens through the model once per row; the prompt's keys
and values do not depend on the response, so one forward per distinct prompt, its KV
cache then indexed out to every row of its group, gives the same states with 1/n of the
prompt's FLOPs. The gradient of a shared prompt is the sum over its group, which the
indexing's backward (index_add) produces.
"""

from __future__ import annotations

import torch


def unique_prompts(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct rows of a left-padded prompt batch and where each row went.

    prompt_ids, prompt_mask: (B, P). Two rows are the same prompt when both their ids and
    their masks agree (a PAD id may also be a real token: PAD == EOS tokenizers).
    Returns unique_ids (U, P), unique_mask (U, P) in prompt_mask's dtype and inverse (B,)
    long with unique_ids[inverse] == prompt_ids; U <= B, the rows in sorted order.
    """
    P = prompt_ids.shape[1]
    key = torch.cat([prompt_ids.long(), prompt_mask.long()], dim=1)  # (B, 2P)
    rows, inverse = torch.unique(key, dim=0, return_inverse=True)
    return rows[:, :P].to(prompt_ids.dtype), rows[:, P:].to(prompt_mask.dtype), inverse
