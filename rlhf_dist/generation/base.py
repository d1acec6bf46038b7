"""The one interface of every rollout sampler (`Sampler`) and what it returns (`Samples`).

A sampler turns left-padded prompts into responses. Four implement it: the trainer's own
KV-cache decode loop (hf.py, generation.backend=hf), an in-process vLLM engine (vllm.py,
backend=vllm), the rollout servers' client (server.py, backend=server) and that client
with up to k rollouts requested ahead (prefetch.py, ppo.max_staleness). The rollout
(rollout/collect.py) and the trainer read a sampler only through this protocol: its
capability flags say what differs between them, never its type.

A rollout calls, in order: `sync` (bring the sampler to the actor's current weights),
`sample` (or, for the episodes an environment plays through the servers' chat endpoint,
`servers` and `episodes`), then `sleep` (free what the sampler holds for scoring and the
update). The trainer calls `expect_next` before each iteration, `stats` after it and
`close` when the run stops on a failure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from rlhf_dist.config import GenerationConfig
from rlhf_dist.data.vision import RowMedia
from rlhf_dist.engine.sampling import Sampling
from rlhf_dist.errors import ConfigError

if TYPE_CHECKING:
    from rlhf_dist.distributed import Runtime
    from rlhf_dist.generation.server import ServerEngine

StopIds = Sequence[int]  # the token ids that end a response
# [(seed, n)] covering a batch's rows in order: each n rows sample what a batch of those n
# prompts samples alone seeded with `seed` (the rollout server's requests, merged or not)
Seeds = Sequence[tuple[int, int]]
# () -> a context yielding (actor module, keep_in_step or None): the actor's weights as a
# sampler reads them (rollout models' generation_context: Runtime.generation_context, with
# LoRA merged; the rollout servers' sync: the partitions, gathered a bucket at a time)
GenerationContext = Callable[[], AbstractContextManager[tuple[Any, Any]]]


class Prompts(Protocol):
    """A batch of prompts as the samplers read it (rollout.batch.PromptBatch): ids and
    attention mask (B, P), left-padded."""

    @property
    def ids(self) -> torch.Tensor: ...

    @property
    def mask(self) -> torch.Tensor: ...


@dataclass(frozen=True)
class Samples:
    """One sampled response per prompt row, rows in prompt order.

    response_ids: (B, T) int64, PAD after each response (T >= 1: the longest response;
    a response is cut after its first stop token by the rollout, not here).
    logprobs: (B, T) float32, the sampler's own log-prob of each sampled token (0 on
    padding), the behaviour policy of ppo.rollout_correction; None where the sampler is the
    trainer's own forward (hf), whose log-probs the rollout computes anyway, unless
    `sample` was asked for them (`logprobs`: the rollout server).
    versions: (B,) int64, the policy version each row was sampled under (the rollout
    servers' weight version); with ppo.partial_rollouts (B, T), each token's own (a row's
    may rise mid-response; -1 on padding); None where the sampler has no versions (it
    samples the actor's current weights: hf, in-process vLLM).
    routing: (B, P + T, L, k) int64, a mixture-of-experts sampler's top-k expert indices
    of every prompt and response token in each of its L routed layers (ppo.routing_replay
    r3, models/routing.py), -1 where no forward routed the token (the last sampled one);
    None unless the sampler was made to record them (the decode loop, the servers)."""

    response_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    versions: torch.Tensor | None = None
    routing: torch.Tensor | None = None


class Sampler(Protocol):
    """What samples a rollout's responses (module docstring for the call order).

    from_actor: the sampler decodes with the trainer's actor itself (hf): the rollout
    samples and scores in one span of whole weights (one gather under ZeRO-3), and a
    multi-turn rollout decodes its turns with the actor directly (rollout/agent.py).
    in_step: `sample` must be called by every rank together, as many times (the servers'
    client agrees on failures over the ranks; the decode loop keeps ZeRO-3's per-layer
    gathers matched): a multi-turn rollout then has a rank without episodes left sample
    a throw-away token while the others play.
    version: the policy version of the weights the last `sample` used (0: none synced, or
    a sampler without versions)."""

    from_actor: bool
    in_step: bool

    @property
    def version(self) -> int: ...

    def sync(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, gen: GenerationConfig,
        stop_ids: StopIds, tokenizer: Any,
    ) -> None:  # fmt: skip
        """Before a rollout of the prompts (B, P): give the sampler the actor's current
        weights (every rank together: under ZeRO-3 they are gathered), and check them
        where asked (debug.check_vllm_sync samples the first prompt rows). Nothing for a
        sampler that decodes with the actor itself."""
        ...

    def sample(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, gen: Sampling,
        stop_ids: StopIds, pad_id: int, rows_per_pass: int | None = None,
        seeds: Seeds | None = None, logprobs: bool = False, media: RowMedia | None = None,
    ) -> Samples:  # fmt: skip
        """One response per left-padded prompt (B, P) with the sampling keys `gen` (a
        GenerationConfig, or a served request's keys), stopping at any of `stop_ids`, PAD
        (`pad_id`) after it. rows_per_pass: the most rows one decode pass holds (the
        rollout's micro batch; None: all); a sampler that schedules its own batches
        ignores it.

        seeds (the rollout server, serving/policy.py; None for the trainer): [(seed, n)]
        covering the rows in order, each n rows drawing from randomness of their own seeded
        with `seed`, so they sample what a batch of those n prompts samples alone with that
        seed, whatever else is in the batch (up to a forward's float rounding at another
        batch shape), and the process's global RNG is left alone. The decode loop gives
        each group a torch.Generator seeded with `seed` (engine/sampling.py
        sample_categorical `streams`; one pass over all rows: ValueError with a
        rows_per_pass below B); vLLM gives each row of a group the seed the global RNG
        seeded with `seed` would draw for it (vllm.py `group_seeds`). None: the global RNG,
        as always. The servers' client draws its shards' seeds itself: ValueError.
        logprobs: Samples.logprobs is wanted even from a sampler whose log-probs the
        rollout computes (hf): it scores its responses, cut after the first stop token, by
        the actor's own forward at gen.temperature (engine/forward.py token_logprobs).
        media: a vision run's pixel inputs of each row's images (data/vision.py), which
        the prefill takes; the decode loop (generation.backend=hf), the vLLM engine
        (vllm, LLaVA-style policies) and the rollout servers' client (server) sample
        images (`refuse_images` in the others)."""
        ...

    def sleep(self) -> None:
        """After the rollout's sampling: free the memory the sampler holds in this process
        (vLLM's KV cache and weights on the GPU) for scoring and the update."""
        ...

    def expect_next(self, iteration: int, upcoming: Prompts | None) -> None:
        """Before iteration `iteration`: called once with None (naming the iteration), then
        once per later iteration whose prompts a sampler k steps off-policy requests while
        this one trains, in iteration order (ppo.max_staleness; none with k = 0)."""
        ...

    def stats(self, runtime: Runtime) -> dict[str, float]:
        """The sampler's own metrics of the last rollout (weight sync, policy version,
        staleness); {} where it has none. A collective: every rank calls it."""
        ...

    def servers(self) -> ServerEngine | None:
        """The rollout servers' client this sampler samples through (the one behind a
        prefetcher), whose chat endpoint an environment plays against; None: no servers."""
        ...

    def episodes(self, prompts: Prompts, play: Callable[[Any], Callable[[], list]]) -> list:
        """The multi-turn episodes of `prompts` played against the servers, after `sync`:
        an environment through their endpoint (generation.environment_endpoint,
        rollout/endpoint.py `request`) or this process's tools and environments, every
        turn a request to them (rollout/agent.py `request_episodes`). `play(prompts)` names
        them and returns the work that plays them. Only samplers with `servers()` play
        episodes."""
        ...

    def close(self) -> None:
        """The run stops (a failure): wait for nothing in flight."""
        ...


class OnPolicyInProcess:
    """What a sampler in this process that samples the weights it was just synced to has
    nothing to do for (the decode loop, vLLM): no rollout requested ahead, no statistics
    of its own, no servers behind it, nothing in flight to close."""

    version = 0  # no versions: every rollout samples the current weights

    def expect_next(self, iteration: int, upcoming: Prompts | None) -> None:
        """Nothing: it samples on-policy, when asked."""

    def stats(self, runtime: Runtime) -> dict[str, float]:
        return {}

    def servers(self) -> ServerEngine | None:
        return None

    def episodes(self, prompts: Prompts, play: Callable[[Any], Callable[[], list]]) -> list:
        raise NotImplementedError(
            f"{type(self).__name__} plays no endpoint episodes: rollout servers do"
        )

    def close(self) -> None:
        """Nothing in flight."""


def refuse_images(media: RowMedia | None) -> None:
    """One line for a sampler that does not take images yet (the rollout servers one
    step off-policy): the run's prompts hold some (docs/vision.md)."""
    if media is not None and media.joined() is not None:
        raise ConfigError(
            "generation.backend: images are sampled by the decode loop (hf), vLLM (vllm) "
            "and on-policy rollout servers (server) only so far"
        )
