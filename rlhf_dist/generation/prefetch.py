"""One-step-off-policy rollouts from the rollout servers (ppo.max_staleness=1;
docs/serving.md, "Asynchronous rollouts").

`PrefetchingServer` is a Sampler (generation/base.py) that wraps the `ServerEngine`. At iteration k, load_weights(): wait for the
rollout requested during iteration k-1 (sampled by the weights the trainer started k-1
with), then sync the trainer's current weights to the servers (they are idle now: a sync
never changes weights under a running request); generate(): request iteration k+1's
prompts on a background thread and return iteration k's rollout. Scoring and the update
of iteration k run on the main thread while the servers sample k+1. An environment that
drives the policy through the chat endpoint (generation.environment_endpoint) is one
step off the same way: episodes() returns iteration k's episodes, played by the weights
k-1 started with, and starts iteration k+1's (the environment runs on the trainer's
threads, its turns on the servers). The background thread only does HTTP and the
environment's own work; every collective (the ranks' agreement on failures, the sync's
gathers) stays on the main thread.

Every rollout carries the iteration whose weights sampled it and the server's policy
version. Its staleness is the number of updates between those weights and the ones it
trains: 1 in the steady state, 0 for the first iteration and after a checkpoint. One
older than ppo.max_staleness is never trained on: it is dropped, counted, and the prompts
sampled again by the current weights.

Exact resume: nothing is requested ahead across an iteration that writes a scheduled
checkpoint (the trainer passes no upcoming prompts there), so the iteration after it
samples on-policy in the unbroken run as in a resumed one; a run stopped between
checkpoints (SIGKILL, a server failure) resumes from the last checkpoint bitwise. A
SIGTERM checkpoint drops the rollout in flight; the resumed run samples it again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from rlhf_dist.config import GenerationConfig
from rlhf_dist.data.vision import RowMedia
from rlhf_dist.engine.sampling import Sampling
from rlhf_dist.errors import ServerError, UserError
from rlhf_dist.generation.base import Prompts, Samples, Seeds, StopIds, refuse_images
from rlhf_dist.generation.server import ServerEngine, _no_seeds, _versions

if TYPE_CHECKING:
    from rlhf_dist.distributed import Runtime

PromptBatch = Prompts  # rollout.batch.PromptBatch, as the samplers read it


@dataclass
class InFlight:
    """A rollout requested from the servers: its prompts (B, P) and their mask, the
    answers to come (with the request's seconds: [(url, answer)] of /generate, or the
    episodes an environment played), the iteration whose weights the servers held
    (`sampled_at`) and their policy version."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    answers: Future
    sampled_at: int
    version: int

    def matches(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> bool:
        return self.prompt_ids.shape == prompt_ids.shape and bool(
            torch.equal(self.prompt_ids, prompt_ids) and torch.equal(self.prompt_mask, prompt_mask)
        )


def _timed(ask: Callable[[], list]) -> tuple[list, float]:
    start = time.perf_counter()
    answers = ask()
    return answers, time.perf_counter() - start


class PrefetchingServer:
    """The rollout servers' client with one rollout requested ahead (module docstring)."""

    from_actor = False
    in_step = True  # the ranks wait for every answer together

    def __init__(self, server: ServerEngine, max_staleness: int):
        self.server, self.max_staleness = server, max_staleness
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-request")
        self.in_flight: InFlight | None = None
        self.iteration = 0  # the iteration about to sample (expect)
        self.upcoming: PromptBatch | None = None
        self.synced = (0, 0)  # (iteration, version) of the last sync
        self.dropped = 0  # rollouts dropped for staleness, this run
        # the last rollout handed out: its staleness (updates), version, request seconds
        self.staleness, self.version, self.request_seconds = 0, 0, 0.0

    def expect(self, iteration: int, upcoming: PromptBatch | None) -> None:
        """Before iteration `iteration`: the prompts of the next one, to request once this
        one's weights are synced (None: request nothing ahead; the last iteration, or one
        that writes a checkpoint)."""
        self.iteration, self.upcoming = iteration, upcoming

    def load_weights(self, actor: torch.nn.Module) -> None:
        """Wait until the servers have answered the rollout in flight (it stays in its
        slot), then sync `actor`'s weights: the servers are idle, so a sync never changes
        weights under a running request. collect.py calls it inside the sync context
        (under ZeRO-3 the buckets' gathers; with LoRA the merged weights)."""
        if self.in_flight is not None:
            self.server.together(self.in_flight.answers.result)  # failures: all ranks at once
        self.server.load_weights(actor)
        self.synced = (self.iteration, self.server.version)

    def sleep(self) -> None:
        """Nothing to free in this process: the engine lives in the servers."""

    def close(self) -> None:
        """Stop waiting for a request in flight (the run ends); HTTP timeouts bound it."""
        self.pool.shutdown(wait=False, cancel_futures=True)

    def sync(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, gen: GenerationConfig,
        stop_ids: StopIds, tokenizer: Any,
    ) -> None:  # fmt: skip
        """`load_weights` of the actor inside the servers' client's `weights` context."""
        assert self.server.weights is not None, "PrefetchingServer.sync without the actor's weights"
        with self.server.weights() as (actor, _):
            self.load_weights(actor)

    def sample(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, gen: Sampling,
        stop_ids: StopIds, pad_id: int, rows_per_pass: int | None = None,
        seeds: Seeds | None = None, logprobs: bool = False, media: RowMedia | None = None,
    ) -> Samples:  # fmt: skip
        """`generate`: each row stamped with the version that sampled it (maybe one sync
        old). No `seeds`, as ServerEngine.sample."""
        _no_seeds(seeds)
        refuse_images(media)
        ids, logprobs = self.generate(prompt_ids, prompt_mask, gen, stop_ids, pad_id)
        return Samples(ids, logprobs, _versions(ids, self.version))

    def expect_next(self, iteration: int, upcoming: Prompts | None) -> None:
        """`expect`: the prompts requested once this iteration's weights are synced."""
        self.expect(iteration, upcoming)

    def stats(self, runtime: Runtime) -> dict[str, float]:
        """The servers' client's statistics (the version: the one that sampled the rollout),
        the rollout's staleness over the ranks, the rollouts dropped as too stale so far and
        the seconds the servers took for it (on a background thread, beside the previous
        iteration's update). A collective."""
        staleness = torch.tensor(float(self.staleness), dtype=torch.float64)
        return self.server.stats(runtime) | {
            "rollout/policy_version": float(self.version),
            "rollout/staleness_mean": float(runtime.all_sum(staleness)) / runtime.world_size,
            "rollout/staleness_max": float(runtime.all_max(staleness)),
            "rollout/stale_dropped": float(self.dropped),
            "time/generate_request": float(
                runtime.all_max(torch.tensor(self.request_seconds, dtype=torch.float64))
            ),
        }

    def servers(self) -> ServerEngine | None:
        """The client behind this one (the endpoint's episodes talk to its servers)."""
        return self.server

    def generate(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, gen_cfg: Sampling,
        stop_ids: StopIds, pad_id: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """This iteration's rollout of the prompts (B, P) -> (response_ids (B, T),
        sampler_logprobs (B, T)), as ServerEngine.generate; after `load_weights`. Requests
        the next iteration's prompts before it returns. Another call (held-out
        evaluation) samples its prompts with the synced weights and leaves the rollout in
        flight for its iteration."""

        def ask(ids: torch.Tensor, mask: torch.Tensor) -> Callable[[], list]:  # seeds drawn now
            return self.server.request(ids, mask, gen_cfg, stop_ids)

        ready = self._ready(prompt_ids, prompt_mask, ask)
        out = self._responses(ready, pad_id, prompt_ids.device)
        self._ask_ahead(lambda batch: ask(batch.ids, batch.mask))
        return out

    def episodes(
        self, prompts: PromptBatch, play: Callable[[PromptBatch], Callable[[], list]]
    ) -> list:
        """This iteration's episodes of `prompts` (generation.environment_endpoint), as
        `generate` does a plain rollout: the ones played ahead by the weights of the last
        iteration, else played now; then the next iteration's are started. `play(batch)`
        names the episodes on this thread (their ids come from the checkpointed RNG) and
        returns the work that plays them (rollout/endpoint.py `request`)."""
        ready = self._ready(prompts.ids, prompts.mask, lambda ids, mask: play(prompts))
        # an environment's error or a server's, on any rank, stops every rank at once
        episodes, seconds = self.server.together(
            ready.answers.result, errors=(ServerError, UserError)
        )
        self._record(ready, seconds)
        self._ask_ahead(play)
        return episodes

    def _ready(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, ask: Callable
    ) -> InFlight:
        """The request in flight for these prompts when it is recent enough, else a new one
        (`ask(ids, mask)` -> its work), sampled by the weights of the last sync."""
        ready, held = None, self.in_flight
        if held is not None and held.matches(prompt_ids, prompt_mask):
            ready, self.in_flight = held, None
        if ready is not None and self.iteration - ready.sampled_at > self.max_staleness:
            self.dropped, ready = self.dropped + 1, None  # never trained on
        if ready is None:  # on-policy: the first iteration, after a checkpoint, evaluation
            ready = self._submit(prompt_ids, prompt_mask, ask(prompt_ids, prompt_mask))
        return ready

    def _ask_ahead(self, ask: Callable[[PromptBatch], Callable[[], list]]) -> None:
        """Once per iteration: start the next iteration's request (`ask(batch)` -> its work)."""
        if self.upcoming is not None and self.in_flight is None:
            batch, self.upcoming = self.upcoming, None
            self.in_flight = self._submit(batch.ids, batch.mask, ask(batch))

    def _submit(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, work: Callable[[], list]
    ) -> InFlight:
        """Run `work` on the background thread (HTTP, and an environment's own work)."""
        future = self.pool.submit(_timed, work)
        return InFlight(prompt_ids, prompt_mask, future, *self.synced)

    def _responses(
        self, ready: InFlight, pad_id: int, device: torch.device | str | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Wait for `ready` on every rank together -> its padded tensors; records its
        staleness, version and request seconds for the statistics."""
        answers, seconds = self.server.together(ready.answers.result)
        out = self.server.together(
            lambda: self.server.responses(answers, ready.version, pad_id, device)
        )
        self._record(ready, seconds)
        return out

    def _record(self, ready: InFlight, seconds: float) -> None:
        self.staleness = self.iteration - ready.sampled_at
        self.version, self.request_seconds = ready.version, seconds
