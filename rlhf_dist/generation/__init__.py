"""Rollout samplers behind one interface (base.py `Sampler`, returning `Samples`): the
trainer's decode loop (hf.py), in-process vLLM (vllm.py), the rollout servers' client
(server.py) and its one-step-off-policy prefetcher (prefetch.py); `make_sampler` picks one
from generation.backend. Below rollout and serving, above models and engine."""

from rlhf_dist.generation.base import Prompts, Sampler, Samples
from rlhf_dist.generation.factory import make_sampler
from rlhf_dist.generation.hf import HFSampler

__all__ = ["HFSampler", "Prompts", "Sampler", "Samples", "make_sampler"]
