"""Partial rollouts: weight updates that land while the served policy generates
(ppo.partial_rollouts; docs/serving.md, "Partial rollouts").

An update sent for partial rollouts is not written into the served weights as its buckets
arrive (the decode loop holds them): its tensors are kept (`Staging`), and once its last
bucket is in, the served policy swaps the whole update in at the next step boundary of
the decode loop (engine/decode.py `StepWatch.swapped`), or at once when nothing decodes.
The weights are never torn: a step runs under one version, and an update that stops
half-way is never swapped in. The loop then recomputes the KV cache of the prompt and
the tokens so far under the new weights, so the rest of the response is what the new
weights would sample after that prefix (PipelineRL, Piche et al. 2025; NeMo-RL's
in-flight weight updates).

`PartialDecode` records, for every sampled token, the version it was sampled under and
its behaviour log-prob log softmax(logits / T) of the full vocabulary (as the served
log-probs are, policy.py), taken from the very logits it was drawn from.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rlhf_dist.config import PerfConfig
from rlhf_dist.engine.decode import generate
from rlhf_dist.engine.sampling import Sampling

Staged = list[tuple[Any, torch.Tensor]]  # (policy.TensorSpec, received tensor), in order


class Staging:
    """The buckets of the update being received and the whole update ready to swap in.
    Any thread: the weight-sync thread adds, the model thread takes."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.filling: tuple[int, Staged] = (0, [])  # (version, buckets so far)
        self.ready: tuple[int, Staged] | None = None  # a whole update not swapped in yet

    def add(self, version: int, items: Staged, final: bool) -> None:
        """One received bucket of update `version`; the buckets of an older update that
        never finished are dropped. A whole update waiting behind a newer one is applied
        first: the newer may hold only some weights (LoRA adapters)."""
        with self.lock:
            got = self.filling[1] if self.filling[0] == version else []
            self.filling = (version, got + items)
            if final:
                before = [] if self.ready is None else self.ready[1]
                self.ready, self.filling = (version, before + self.filling[1]), (0, [])

    def take(self) -> tuple[int, Staged] | None:
        """The whole update ready to swap in (None: none), no longer staged."""
        with self.lock:
            ready, self.ready = self.ready, None
        return ready


class PartialDecode:
    """engine/decode.py StepWatch of one partial generate call: per-token versions and
    behaviour log-probs; `swap()` -> the new version when it swapped weights in, else None."""

    def __init__(self, temperature: float, version: int, swap: Callable[[], int | None]):
        self.temperature, self.version, self.swap = temperature, version, swap
        self.logprobs: list[torch.Tensor] = []  # per step, (B,)
        self.versions: list[int] = []  # per step

    def sampled(self, logits: torch.Tensor, token: torch.Tensor) -> None:
        logp = torch.log_softmax(logits.float() / self.temperature, dim=-1)
        self.logprobs.append(logp.gather(1, token[:, None])[:, 0])
        self.versions.append(self.version)

    def swapped(self, tokens: int) -> bool:
        new = self.swap()
        if new is None:
            return False
        self.version = new
        return True


@dataclasses.dataclass(frozen=True)
class _PadOnly:
    """What `generate` reads of a tokenizer when given the stop ids."""

    pad_token_id: int
    eos_token_id: int | None = None


def decode_partial(
    model: torch.nn.Module, prompt: tuple[torch.Tensor, torch.Tensor], s: Sampling,
    stops: Sequence[int], pad: int, seeds: Sequence[tuple[int, int]], perf: PerfConfig,
    watch: PartialDecode,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The decode loop over left-padded prompts (ids, mask (B, P)) with `watch` between
    its steps -> (ids (B, T), behaviour log-probs (B, T) float32, versions (B, T) int64).
    Each (seed, n) group of rows draws from its own generator, as the hf sampler's `seeds`
    (generation/hf.py). Without packed linears (perf.packed_linears): their packed copies
    would keep the old weights after a swap."""
    ids, mask = prompt
    streams = [(torch.Generator(device=ids.device).manual_seed(seed), n) for seed, n in seeds]
    unpacked = dataclasses.replace(perf, packed_linears=False)
    out = generate(
        model, ids, mask, s, _PadOnly(pad), None, stops, unpacked, streams, None, watch
    )  # fmt: skip
    logprobs = torch.stack(watch.logprobs, dim=1)[:, : out.shape[1]]
    versions = torch.tensor(watch.versions[: out.shape[1]], dtype=torch.long)
    return out, logprobs, versions.expand(out.shape[0], -1)
