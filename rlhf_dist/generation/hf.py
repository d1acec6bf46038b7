"""The trainer's own sampler (generation.backend=hf): engine/decode.py's KV-cache decode
loop over the actor, inside the generation context (under ZeRO-3 the gathered weights,
or the per-layer gathers kept in step; with LoRA the adapters merged)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from rlhf_dist.config import GenerationConfig, PerfConfig
from rlhf_dist.engine.decode import generate, pad_columns
from rlhf_dist.engine.forward import DEFAULT_PERF
from rlhf_dist.generation.base import GenerationContext, Prompts, Samples, StopIds

if TYPE_CHECKING:
    from rlhf_dist.distributed import Runtime
    from rlhf_dist.generation.server import ServerEngine


@dataclass(frozen=True)
class _PadOnly:
    """What engine/decode.py's `generate` reads of a tokenizer when given the stop ids."""

    pad_token_id: int
    eos_token_id: int | None = None


class HFSampler:
    """The decode loop over the actor (Sampler; no versions, no weight sync: it samples
    the actor's current weights)."""

    from_actor = True
    in_step = True  # ZeRO-3 without gathered weights: every forward is a collective
    version = 0

    def __init__(
        self, generation_context: GenerationContext | None, perf: PerfConfig = DEFAULT_PERF
    ):
        """generation_context: () -> context yielding (actor, keep_in_step) (None: a
        rollout models' that never samples, e.g. a scoring-only test); perf: the decode
        loop's speed paths."""
        self.generation_context, self.perf = generation_context, perf

    def sync(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, gen: GenerationConfig,
        stop_ids: StopIds, tokenizer: Any,
    ) -> None:  # fmt: skip
        """Nothing: the decode loop reads the actor's weights themselves."""

    def sample(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, gen: GenerationConfig,
        stop_ids: StopIds, pad_id: int, rows_per_pass: int | None = None,
    ) -> Samples:  # fmt: skip
        """`generate` on each pass of `rows_per_pass` rows in order (the global RNG draws
        as one call per pass), all inside one generation context; the passes' responses
        right-padded to the longest. No sampler log-probs: the rollout's forward gives
        them."""
        assert self.generation_context is not None, "HFSampler without a generation context"
        n = prompt_ids.shape[0]
        step = rows_per_pass or n
        tokenizer = _PadOnly(pad_id)
        with self.generation_context() as (actor, keep_in_step):
            responses = [
                generate(
                    actor,
                    prompt_ids[s],
                    prompt_mask[s],
                    gen,
                    tokenizer,
                    keep_in_step,
                    stop_ids,
                    self.perf,
                )  # fmt: skip
                for s in _passes(n, step)
            ]
        width = max(r.shape[1] for r in responses)
        return Samples(torch.cat([pad_columns(r, width, pad_id) for r in responses]))

    def sleep(self) -> None:
        """Nothing held besides the actor."""

    def expect_next(self, iteration: int, upcoming: Prompts | None) -> None:
        """Nothing: it samples on-policy, when asked."""

    def stats(self, runtime: Runtime) -> dict[str, float]:
        return {}

    def servers(self) -> ServerEngine | None:
        return None

    def episodes(self, prompts: Prompts, play: Callable[[Any], Callable[[], list]]) -> list:
        raise NotImplementedError("the decode loop plays no endpoint episodes: rollout servers do")

    def close(self) -> None:
        """Nothing in flight."""


def _passes(n: int, step: int) -> Iterator[slice]:
    """The row slices of n rows, `step` at a time."""
    return (slice(i, i + step) for i in range(0, n, step))
