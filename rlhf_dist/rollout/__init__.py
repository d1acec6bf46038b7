"""What a rollout is: sample responses to a rank's prompts, then score them with every
model the update needs (docs/architecture.md section 5). `collect.py` runs it through the
run's sampler (rlhf_dist.generation: the decode loop, vLLM or the rollout servers) and
`agent.py` as multi-turn episodes with tools; `batch.py` holds the frozen `RolloutBatch`.
"""

from __future__ import annotations

from rlhf_dist.rollout.batch import PromptBatch, RolloutBatch
from rlhf_dist.rollout.collect import RolloutModels, collect_rollout

__all__ = ["PromptBatch", "RolloutBatch", "RolloutModels", "collect_rollout"]
