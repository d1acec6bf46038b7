"""k-step off-policy rollouts from the rollout servers (ppo.max_staleness=k; docs/serving.md,
"Asynchronous rollouts").

`PrefetchingServer` is a Sampler (generation/base.py) that wraps the `ServerEngine` and keeps
up to k rollouts requested ahead, oldest first. Before iteration i the trainer names the
prompts of the iterations to request while i trains (trainers/ppo/rollout.py `expect_next`:
up to i + k, never past an iteration that writes a scheduled checkpoint); each is sampled by
the weights iteration i started with. So the rollout trained at iteration i was sampled by the
weights of iteration max(c + 1, i - k), c the last scheduled checkpoint before i (0 at the
start): its staleness is min(i - c - 1, k) updates, in an unbroken run as in a resumed one.

One FIFO worker thread does all the HTTP, in the order the main thread asked for it; every
collective (the ranks' agreement on failures, under ZeRO-3 the sync's gathers) stays on the
main thread. A sync never changes weights under a running request. Two ways to keep that:

- drained (k = 1, several trainer ranks, ZeRO-3): load_weights() waits until the servers have
  answered every request in flight, then syncs on the main thread. With k > 1 this is exact
  but overlaps no more than k = 1: the sync of iteration i waits for the request of i + k - 1.
- deferred (one trainer process, k > 1): load_weights() copies the actor's trainable weights
  to the host (a snapshot) and queues their sync behind the requests in flight; the worker
  loads them into a shadow copy of the actor and syncs that (post-sync check included), then
  serves the requests queued after it. The servers need not wait for the trainer, the trainer
  waits only for the rollout it trains. Cost: up to k snapshots and one shadow actor.

Multi-turn episodes are k steps off the same way, an environment that drives the policy
through the chat endpoint (generation.environment_endpoint) or this process's tools and
environments: episodes() returns iteration i's episodes and starts the ones named ahead
(the environment or the tools run on the worker, the turns on the servers).

Every rollout carries the iteration whose weights sampled it and the servers' policy version
then. One older than ppo.max_staleness is never trained on: it is dropped, counted, and the
prompts sampled again by the current weights. The statistics log the staleness over the
ranks, the queue's depth and the response lengths sampled and trained: a filter that drops
stale rollouts shows there whether it biases the trained lengths (long responses are slow).

Partial rollouts (ppo.partial_rollouts, one trainer process): the deferred syncs run on a
second worker thread of their own, beside the requests, so an update reaches the servers
while they generate; a response being decoded then continues under the new weights
(serving/partial.py) and every token carries the version that sampled it (Samples.versions
(B, T)); a request waits for the sync queued before it (so the first samples synced
weights, and each rollout's tokens are no older than the sync before its request). The
statistics add each trained token's staleness, in versions behind the weights
the trainer trains (the last sync checked plus the syncs queued after it), and the share of
rows whose version changed inside the response. Where an update lands in a response depends
on timing: such a run is not bitwise reproducible, nor resumed bitwise.

Exact resume: nothing is requested ahead across an iteration that writes a scheduled
checkpoint, so the iteration after it samples on-policy in the unbroken run as in a resumed
one; a run stopped between checkpoints (SIGKILL, a server failure) resumes from the last
checkpoint bitwise. A SIGTERM checkpoint drops the rollouts in flight; the resumed run samples
them again, on-policy.
"""

from __future__ import annotations

import copy
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from rlhf_dist.config import GenerationConfig
from rlhf_dist.data.vision import RowMedia
from rlhf_dist.distributed.zero3 import is_partitioned
from rlhf_dist.engine.sampling import Sampling
from rlhf_dist.errors import ConfigError, ServerError, UserError
from rlhf_dist.generation.base import Prompts, Samples, Seeds, StopIds, refuse_images
from rlhf_dist.generation.server import ServerEngine, _no_seeds, _versions, token_versions

if TYPE_CHECKING:
    from rlhf_dist.distributed import Runtime

PromptBatch = Prompts  # rollout.batch.PromptBatch, as the samplers read it
Snapshot = dict[str, torch.Tensor]  # the actor's trainable weights by name, on the host


@dataclass
class InFlight:
    """A rollout requested from the servers: its prompts (B, P) and their mask, the `Answer`
    to come and the iteration whose weights sample it (`sampled_at`)."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    answers: Future
    sampled_at: int

    def matches(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> bool:
        return self.prompt_ids.shape == prompt_ids.shape and bool(
            torch.equal(self.prompt_ids, prompt_ids) and torch.equal(self.prompt_mask, prompt_mask)
        )


@dataclass(frozen=True)
class Answer:
    """One request as the worker did it: the answers ([(url, answer)] of /generate, or the
    episodes an environment played), its seconds and the servers' policy version then."""

    answers: list
    seconds: float
    version: int


@dataclass
class LengthTally:
    """This iteration's response tokens and rows: of the rollouts that came back (sampled)
    and of those trained on (not dropped as too stale)."""

    now: list[float]  # [sampled tokens, sampled rows, trained tokens, trained rows]

    def add(self, answers: list, trained: bool) -> None:
        """Count a rollout's /generate answers [(url, answer)] (episodes have no lengths here)."""
        generated = [a[1] for a in answers if isinstance(a, tuple) and isinstance(a[1], dict)]
        lengths = [len(r) for a in generated for r in a.get("responses", [])]
        counts = [float(sum(lengths)), float(len(lengths))] * (2 if trained else 1)
        for i, c in enumerate(counts):
            self.now[i] += c


def response_lengths(runtime: Runtime, tally: LengthTally) -> dict[str, float]:
    """async/{sampled,trained}_len_mean (mean response tokens per row) and *_rows of this
    iteration over every rank, a collective (the run's cumulative comparison weighs the
    means by the rows); {} when no rank counted a row (endpoint episodes)."""
    tokens, rows, kept_tokens, kept_rows = runtime.all_sum(
        torch.tensor(tally.now, dtype=torch.float64)
    ).tolist()
    if not rows:
        return {}
    return {
        "async/sampled_len_mean": tokens / rows,
        "async/trained_len_mean": kept_tokens / max(kept_rows, 1.0),
        "async/sampled_rows": rows,
        "async/trained_rows": kept_rows,
    }


def _same(x: torch.Tensor) -> torch.Tensor:
    """The maximum over one trainer rank: x itself (the deferred syncs' `all_max`)."""
    return x


def server_all_max(
    runtime: Runtime, max_staleness: int, partial: bool = False
) -> tuple[Callable[[torch.Tensor], torch.Tensor], bool]:
    """(the servers' client's `all_max`, whether the syncs are deferred): one trainer process
    with k > 1 or partial rollouts syncs on a worker thread, where no collective may run,
    and needs none. Partial rollouts with several trainer processes: ConfigError."""
    if partial and runtime.world_size > 1:
        raise ConfigError(
            "ppo.partial_rollouts: one trainer process only (its syncs go out from host "
            f"snapshots beside the requests), not {runtime.world_size}"
        )
    deferred = (max_staleness > 1 or partial) and runtime.world_size == 1
    return (_same if deferred else runtime.all_max), deferred


class PrefetchingServer:
    """The rollout servers' client with up to k rollouts requested ahead (module docstring)."""

    from_actor = False
    in_step = True  # the ranks wait for every answer together

    def __init__(self, server: ServerEngine, max_staleness: int, deferred: bool = False):
        """deferred: sync from snapshots on the worker (one trainer process, k > 1), rather
        than on the main thread once the servers are idle; with server.partial on a
        worker of their own, beside the requests."""
        self.server, self.max_staleness, self.deferred = server, max_staleness, deferred
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-request")
        self.partial = server.partial and deferred
        self.sync_pool = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="partial-sync")
            if self.partial
            else self.pool
        )
        self.syncs_behind = [0, 0]  # partial: syncs queued, syncs done (their versions)
        self.last_sync: Future | None = None  # partial: what the next request waits for
        self.token_versions: torch.Tensor | None = None  # partial: the last rollout's (B, T)
        self.token_staleness: list[float] = []  # partial: [tokens, sum, min, max, rows, switched]
        self.queue: deque[InFlight] = deque()  # requested ahead, oldest first
        self.iteration = 0  # the iteration about to sample (expect)
        self.upcoming: list[PromptBatch] = []  # to request once this iteration's rollout is out
        self.synced_at = 0  # the iteration of the last sync (queued, when deferred)
        self.shadow: torch.nn.Module | None = None  # deferred: the actor the worker syncs
        self.sync_failed: Exception | None = None  # deferred: a sync's error, for the requests
        self.dropped = 0  # rollouts dropped for staleness, this run
        self.lengths = LengthTally([0.0] * 4)
        # the last rollout handed out: its staleness (updates), version, request seconds
        self.staleness, self.version, self.request_seconds = 0, 0, 0.0

    def expect(self, iteration: int, upcoming: PromptBatch | None) -> None:
        """Before iteration `iteration`: one more iteration's prompts to request once this
        one's weights are synced, in iteration order (None: only name the iteration; the
        first call of an iteration forgets what the last one left)."""
        if iteration != self.iteration:
            self.iteration, self.upcoming = iteration, []
            self.lengths.now = [0.0] * 4
        if upcoming is not None:
            self.upcoming.append(upcoming)

    def load_weights(self, actor: torch.nn.Module) -> None:
        """Make `actor`'s weights the ones the next requests sample with. Drained: wait until
        the servers have answered every request in flight (they stay queued), then sync on
        this thread (under ZeRO-3 the buckets' gathers; with LoRA the merged weights).
        Deferred: queue a snapshot's sync behind them (`_sync_shadow`). collect.py calls it
        inside the sync context."""
        if self.deferred and is_partitioned(actor):
            self.deferred = False  # ZeRO-3 partitions: only the gathers make them whole
        if self.deferred:
            self._queue_sync(actor)
        else:
            for held in self.queue:
                self.server.together(held.answers.result)  # failures: all ranks at once
            self.server.load_weights(actor)
        self.synced_at = self.iteration

    def _queue_sync(self, actor: torch.nn.Module) -> None:
        """Deferred: copy `actor`'s trainable weights to the host now and sync them on the
        worker, after the requests already queued and before the ones queued next."""
        if self.shadow is None:
            self.shadow = copy.deepcopy(actor)
            for p in self.shadow.parameters():
                p.grad = None
        snapshot = {
            n: p.detach().to("cpu", copy=True)
            for n, p in actor.named_parameters()
            if p.requires_grad
        }
        self.syncs_behind[0] += 1
        self.last_sync = self.sync_pool.submit(self._sync_shadow, snapshot)

    @torch.no_grad()
    def _sync_shadow(self, snapshot: Snapshot) -> None:
        """On the worker: the snapshot into the shadow actor, then its sync (the post-sync
        check included). An error is kept for the requests after it to raise."""
        if self.sync_failed is not None or self.shadow is None:
            return
        try:
            params = dict(self.shadow.named_parameters())
            for name, weight in snapshot.items():
                params[name].copy_(weight)
            self.server.load_weights(self.shadow)
        except Exception as e:  # raised on the main thread by the next request's result
            self.sync_failed = e
        finally:
            self.syncs_behind[1] += 1

    def sleep(self) -> None:
        """Nothing to free in this process: the engine lives in the servers."""

    def close(self) -> None:
        """Stop waiting for the requests in flight (the run ends); HTTP timeouts bound them."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.sync_pool.shutdown(wait=False, cancel_futures=True)

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
        """`generate`: each row stamped with the version that sampled it (maybe k syncs
        old). No `seeds`, as ServerEngine.sample."""
        _no_seeds(seeds)
        refuse_images(media)
        ids, logprobs = self.generate(prompt_ids, prompt_mask, gen, stop_ids, pad_id)
        if self.token_versions is not None:  # partial rollouts: (B, T), -1 on padding
            return Samples(ids, logprobs, self.token_versions)
        return Samples(ids, logprobs, _versions(ids, self.version))

    def expect_next(self, iteration: int, upcoming: Prompts | None) -> None:
        """`expect`: one more iteration's prompts to request once this one's are synced."""
        self.expect(iteration, upcoming)

    def stats(self, runtime: Runtime) -> dict[str, float]:
        """The servers' client's statistics (the version: the one that sampled the rollout),
        the rollout's staleness over the ranks, the requests queued ahead, the rollouts
        dropped as too stale so far, the seconds the servers took for it (on the worker,
        beside the updates) and the response lengths sampled and trained. A collective."""
        staleness = torch.tensor(float(self.staleness), dtype=torch.float64)
        return (
            self.server.stats(runtime)
            | {
                "rollout/policy_version": float(self.version),
                "rollout/staleness_mean": float(runtime.all_sum(staleness)) / runtime.world_size,
                "rollout/staleness_max": float(runtime.all_max(staleness)),
                "rollout/staleness_min": -float(runtime.all_max(-staleness)),
                "rollout/stale_dropped": float(self.dropped),
                "async/queue_depth": float(
                    runtime.all_max(torch.tensor(float(len(self.queue)), dtype=torch.float64))
                ),
                "time/generate_request": float(
                    runtime.all_max(torch.tensor(self.request_seconds, dtype=torch.float64))
                ),
            }
            | response_lengths(runtime, self.lengths)
            | self._token_stats(runtime)
        )

    def _token_stats(self, runtime: Runtime) -> dict[str, float]:
        """Partial: rollout/token_staleness_{mean,min,max} over the trained response tokens
        of every rank and rollout/version_switched_rows (the share of rows whose version
        changed mid-response); {} otherwise. A collective where partial."""
        if not self.partial:
            return {}
        t = self.token_staleness or [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
        n, total, rows, switched = runtime.all_sum(
            torch.tensor([t[0], t[1], t[4], t[5]], dtype=torch.float64)
        ).tolist()
        if not n:
            return {}
        low = -float(runtime.all_max(torch.tensor(-t[2] if t[0] else -1e18, dtype=torch.float64)))
        high = float(runtime.all_max(torch.tensor(t[3] if t[0] else -1e18, dtype=torch.float64)))
        return {
            "rollout/token_staleness_mean": total / n,
            "rollout/token_staleness_min": low,
            "rollout/token_staleness_max": high,
            "rollout/version_switched_rows": switched / rows,
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
        the iterations named by `expect` before it returns. Another call (held-out
        evaluation) samples its prompts with the weights of the last sync and leaves the
        queue for its iterations."""

        def ask(ids: torch.Tensor, mask: torch.Tensor) -> Callable[[], list]:  # seeds drawn now
            return self.server.request(ids, mask, gen_cfg, stop_ids)

        ready = self._ready(prompt_ids, prompt_mask, ask)
        out = self._responses(ready, pad_id, prompt_ids.device)
        self._ask_ahead(lambda batch: ask(batch.ids, batch.mask))
        return out

    def episodes(
        self, prompts: PromptBatch, play: Callable[[PromptBatch], Callable[[], list]]
    ) -> list:
        """This iteration's episodes of `prompts` (through the endpoint, or this process's
        tools), as `generate` does a plain rollout: the ones played ahead, else played now;
        then the ones `expect` named are started. `play(batch)` names the episodes on this
        thread (their ids or seeds come from the checkpointed RNG) and returns the work
        that plays them (rollout/endpoint.py `request`, rollout/agent.py
        `request_episodes`)."""
        ready = self._ready(prompts.ids, prompts.mask, lambda ids, mask: play(prompts))
        # an environment's error or a server's, on any rank, stops every rank at once
        answer = self.server.together(ready.answers.result, errors=(ServerError, UserError))
        self._record(ready, answer)
        self._ask_ahead(play)
        return answer.answers

    def _ready(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, ask: Callable
    ) -> InFlight:
        """The oldest request in flight when it is for these prompts and recent enough, else
        a new one (`ask(ids, mask)` -> its work), sampled by the weights of the last sync."""
        ready = None
        if self.queue and self.queue[0].matches(prompt_ids, prompt_mask):
            ready = self.queue.popleft()
            if self.iteration - ready.sampled_at > self.max_staleness:
                self._drop(ready)
                ready = None
        if ready is None:  # on-policy: the first iteration, after a checkpoint, evaluation
            ready = self._submit(prompt_ids, prompt_mask, ask(prompt_ids, prompt_mask))
        return ready

    def _drop(self, stale: InFlight) -> None:
        """A rollout too stale to train on: counted, and its lengths as sampled only."""
        self.dropped += 1
        if stale.answers.done() and stale.answers.exception() is None:
            self.lengths.add(stale.answers.result().answers, trained=False)

    def _ask_ahead(self, ask: Callable[[PromptBatch], Callable[[], list]]) -> None:
        """Once per iteration: queue the requests `expect` named (`ask(batch)` -> its work)."""
        for batch in self.upcoming:
            self.queue.append(self._submit(batch.ids, batch.mask, ask(batch)))
        self.upcoming = []

    def _submit(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, work: Callable[[], list]
    ) -> InFlight:
        """Queue `work` on the worker (HTTP, and an environment's own work), after every
        request and deferred sync queued before it (partial: the sync runs on its own worker,
        so a request waits for the one queued before it, whose update landed in the
        requests before)."""
        after = self.last_sync if self.partial else None

        def timed() -> Answer:
            if after is not None:
                after.result()  # its errors are in sync_failed
            if self.sync_failed is not None:  # the weights it should sample never arrived
                raise self.sync_failed
            # partial: the last sync checked (one in flight may move the version meanwhile)
            version = self.server.checked_version if self.partial else self.server.version
            start = time.perf_counter()
            answers = work()
            return Answer(answers, time.perf_counter() - start, version)

        return InFlight(prompt_ids, prompt_mask, self.pool.submit(timed), self.synced_at)

    def _responses(
        self, ready: InFlight, pad_id: int, device: torch.device | str | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Wait for `ready` on every rank together -> its padded tensors; records its
        staleness, version, request seconds and lengths for the statistics."""
        answer = self.server.together(ready.answers.result)
        out = self.server.together(
            lambda: self.server.responses(answer.answers, answer.version, pad_id, device)
        )
        self._record(ready, answer)
        self.lengths.add(answer.answers, trained=True)
        if self.partial:
            self.token_versions = token_versions(answer.answers, device)
            self.token_staleness = self._staleness_of(self.token_versions)
        return out

    def _staleness_of(self, versions: torch.Tensor) -> list[float]:
        """Partial: [tokens, sum, min, max] of the response tokens' staleness (versions
        (B, T), -1 on padding) behind the weights trained now, then [rows, rows whose
        version changed inside the response]."""
        queued, done = self.syncs_behind
        now = self.server.checked_version + queued - done
        real = versions >= 0
        behind = (now - versions)[real].double()
        switched = (versions.amax(1) != versions.masked_fill(~real, 2**62).amin(1)).sum()
        if not behind.numel():
            return []
        return [float(behind.numel()), float(behind.sum()), float(behind.min()),
                float(behind.max()), float(versions.shape[0]), float(switched)]  # fmt: skip

    def _record(self, ready: InFlight, answer: Answer) -> None:
        self.staleness = self.iteration - ready.sampled_at
        self.version, self.request_seconds = answer.version, answer.seconds
