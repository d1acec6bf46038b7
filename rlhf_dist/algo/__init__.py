"""Pure tensor math of RLHF. Imports torch only: no transformers, accelerate or deepspeed.

Conventions (docs/architecture.md section 3): B batch, T response length, `response_mask` (B, T) bool
with True on real response tokens. Every function returns new tensors and never modifies
its inputs.
"""

from __future__ import annotations

from rlhf_dist.algo import advantages, kl, logprobs, losses, masking, preference, rewards

__all__ = ["advantages", "kl", "logprobs", "losses", "masking", "preference", "rewards"]
