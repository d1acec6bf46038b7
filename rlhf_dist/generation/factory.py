"""`make_sampler`: the sampler of a run's rollouts from generation.backend."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch

from rlhf_dist.config import Config
from rlhf_dist.distributed import Runtime
from rlhf_dist.generation.base import GenerationContext, Sampler
from rlhf_dist.generation.hf import HFSampler
from rlhf_dist.generation.prefetch import PrefetchingServer, server_all_max
from rlhf_dist.generation.server import ServerEngine
from rlhf_dist.generation.vllm import VLLMEngine


def make_sampler(
    cfg: Config, runtime: Runtime, model: torch.nn.Module, generation_context: GenerationContext
) -> Sampler:
    """What samples the rollouts of generation.backend: the decode loop over the actor
    inside `generation_context` (hf), vLLM in this process, loaded inside the same context
    (vllm), or the rollout servers (server; docs/serving.md), synced a bucket at a time from
    the actor `model`'s partitions (under ZeRO-3 each bucket gathered on its own; with LoRA
    only the adapters, which the servers fold in), with ppo.max_staleness = k up to k rollouts
    requested ahead (prefetch.py)."""
    backend = cfg.generation.backend
    if backend == "vllm":
        return VLLMEngine(cfg, runtime.device, weights=generation_context)
    if backend == "server":

        def partitions() -> AbstractContextManager[tuple[Any, Any]]:
            return runtime.generation_context(model, "actor", gather=False)

        k = cfg.ppo.max_staleness
        all_max, deferred = server_all_max(runtime, k, cfg.ppo.partial_rollouts)
        server = ServerEngine(cfg, runtime.is_main, all_max, weights=partitions)
        if k:
            return PrefetchingServer(server, k, deferred)
        return server
    return HFSampler(generation_context, cfg.perf, routing=cfg.ppo.routing_replay == "r3")
