"""FSDP2 (`torch.distributed.fsdp.fully_shard`) as the second sharded engine, chosen by the
Accelerate config (`distributed_type: FSDP`, `fsdp_version: 2`); docs/distributed.md.
"""

from __future__ import annotations

import os


def fsdp_launch() -> bool:
    """Whether `accelerate launch` started this process with an FSDP config."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
