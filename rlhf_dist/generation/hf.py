"""The trainer's own sampler (generation.backend=hf): engine/decode.py's KV-cache decode
loop over the actor, inside the generation context (under ZeRO-3 the gathered weights,
or the per-layer gathers kept in step; with LoRA the adapters merged)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from rlhf_dist.config import GenerationConfig, PerfConfig
from rlhf_dist.data.vision import Media, RowMedia
from rlhf_dist.engine.decode import cut_before, generate, pad_columns, truncate_after_eos
from rlhf_dist.engine.forward import DEFAULT_PERF, token_logprobs
from rlhf_dist.engine.sampling import Sampling
from rlhf_dist.generation.base import (
    GenerationContext,
    OnPolicyInProcess,
    Samples,
    Seeds,
    StopIds,
)
from rlhf_dist.models.routing import RoutingSpan, plain_path, recording

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class _PadOnly:
    """What engine/decode.py's `generate` reads of a tokenizer when given the stop ids."""

    pad_token_id: int
    eos_token_id: int | None = None


class HFSampler(OnPolicyInProcess):
    """The decode loop over the actor (Sampler; no versions, no weight sync: it samples
    the actor's current weights)."""

    from_actor = True
    in_step = True  # ZeRO-3 without gathered weights: every forward is a collective

    def __init__(
        self,
        generation_context: GenerationContext | None,
        perf: PerfConfig = DEFAULT_PERF,
        routing: bool = False,
    ):
        """generation_context: () -> context yielding (actor, keep_in_step) (None: a
        rollout models' that never samples, e.g. a scoring-only test); perf: the decode
        loop's speed paths; routing: record a mixture-of-experts actor's routing of every
        decode forward into Samples.routing (ppo.routing_replay r3; the prefill then runs
        every row, not each distinct prompt once)."""
        self.generation_context, self.perf, self.routing = generation_context, perf, routing

    def sync(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, gen: GenerationConfig,
        stop_ids: StopIds, tokenizer: Any,
    ) -> None:  # fmt: skip
        """Nothing: the decode loop reads the actor's weights themselves."""

    def sample(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, gen: Sampling,
        stop_ids: StopIds, pad_id: int, rows_per_pass: int | None = None,
        seeds: Seeds | None = None, logprobs: bool = False, media: RowMedia | None = None,
    ) -> Samples:  # fmt: skip
        """`generate` on each pass of `rows_per_pass` rows in order (the global RNG draws
        as one call per pass; with `seeds`, one pass whose groups draw from generators of
        their own), all inside one generation context; the passes' responses right-padded
        to the longest. No sampler log-probs unless asked (`logprobs`): the rollout's
        forward gives them."""
        assert self.generation_context is not None, "HFSampler without a generation context"
        n = prompt_ids.shape[0]
        step = rows_per_pass or n
        if seeds is not None and step < n:
            raise ValueError(
                f"seeds: the decode loop samples seeded rows in one pass, not {step} of {n} "
                "rows at a time"
            )
        tokenizer = _PadOnly(pad_id)
        perf = plain_path(self.perf) if self.routing else self.perf
        with self.generation_context() as (actor, keep_in_step):
            responses: list[torch.Tensor] = []
            scored: list[torch.Tensor] = []
            routed: list[torch.Tensor] = []
            for s in _passes(n, step):
                ids, mask = prompt_ids[s], prompt_mask[s]
                streams = _streams(seeds, ids.device)
                pixels = None if media is None else media[s].joined()
                span = recording().on(actor) if self.routing else contextlib.nullcontext()
                with span:
                    out = generate(
                        actor, ids, mask, gen, tokenizer, keep_in_step, stop_ids, perf, streams,
                        pixels,
                    )  # fmt: skip
                if isinstance(span, RoutingSpan):  # (b, P + fed tokens, L, k)
                    routed.append(span.recorded(ids.shape[0]))
                if logprobs:
                    prompt = (ids, mask, pixels)
                    image = None if media is None else media.image_token_id
                    out, lp = _scored(actor, prompt, out, gen, (stop_ids, pad_id, image), self.perf)
                    scored.append(lp)
                responses.append(out)
        width = max(r.shape[1] for r in responses)
        ids = torch.cat([pad_columns(r, width, pad_id) for r in responses])
        lps = torch.cat([pad_columns(lp, width, 0.0) for lp in scored]) if logprobs else None
        routing = None
        if routed:  # the last sampled token was never fed: -1 up to P + width
            P = prompt_ids.shape[1]
            routing = torch.cat([pad_routing(r, P + width) for r in routed])
        return Samples(ids, lps, routing=routing)

    def sleep(self) -> None:
        """Nothing held besides the actor."""


def pad_routing(routing: torch.Tensor, width: int) -> torch.Tensor:
    """Right-pad a recorded routing (B, S, L, k) with -1 (not routed) to (B, width, L, k)."""
    B, S, L, k = routing.shape
    if width <= S:
        return routing[:, :width]
    return torch.cat([routing, routing.new_full((B, width - S, L, k), -1)], dim=1)


def _streams(seeds: Seeds | None, device: torch.device) -> list[tuple[torch.Generator, int]] | None:
    """The decode loop's random streams of `seeds`: a generator per group on `device`,
    seeded as torch.manual_seed(seed) seeds the global one (None: the global RNG)."""
    if seeds is None:
        return None
    return [(torch.Generator(device=device).manual_seed(seed), n) for seed, n in seeds]


@torch.no_grad()
def _scored(
    actor: Any, prompt: tuple[torch.Tensor, torch.Tensor, Media | None], out: torch.Tensor,
    gen: Sampling, tokens: tuple[StopIds, int, int | None], perf: PerfConfig,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(responses cut after their first stop token, their float32 log-probs under `actor`
    at gen.temperature, 0 on padding): token_logprobs of the prompts (ids, mask (B, P),
    pixel inputs or None) followed by them. tokens: (stop ids, pad id, a vision model's
    image token or None): a response is scored up to its first image token only (0
    from there), which is never fed, as the rollout cuts it (engine/decode.py
    `cut_before`): the prompt has no image for it."""
    (prompt_ids, prompt_mask, media), (stop_ids, pad_id, image) = prompt, tokens
    out, response_mask, _ = truncate_after_eos(out, stop_ids, pad_id)
    fed, scored = out, response_mask
    if image is not None:
        fed, scored, _ = cut_before(out, response_mask, response_mask.any(1), image, pad_id)
    logprobs, _ = token_logprobs(
        actor, torch.cat([prompt_ids, fed], 1), torch.cat([prompt_mask, scored.long()], 1),
        scored, gen.temperature, prompt_width=prompt_ids.shape[1], perf=perf, media=media,
    )  # fmt: skip
    return out, logprobs.float()


def _passes(n: int, step: int) -> Iterator[slice]:
    """The row slices of n rows, `step` at a time."""
    return (slice(i, i + step) for i in range(0, n, step))
