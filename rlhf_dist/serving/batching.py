"""Concurrent requests sampled as one batch (serve.batch_window_ms; docs/serving.md,
"Batching concurrent requests").

An environment that drives the policy through the OpenAI-compatible endpoints sends one
request per episode turn, many episodes at once (generation.endpoint_episodes_at_once);
several trainer ranks each send their shard's /generate after a sync. Served one at a
time, each decode step of a small batch reads every weight for a few tokens. Here a
request waits up to the window for others with the same sampling keys, and the group is
decoded together: every request with its own seed's generator for its rows
(ServedPolicy.generate `seeds`), so each draws what it would draw alone. Its tokens and
log-probs are the one-at-a-time ones up to the float rounding of a forward at another
batch shape (a near-tie can then break the other way): reproducible within that, not bit
for bit, which is why the window is 0 (off) by default.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from concurrent.futures import Future

from rlhf_dist.serving.policy import PromptMedia, SamplingRequest, ServedPolicy


@dataclasses.dataclass
class Waiting:
    """One request: its prompts, its sampling keys and where its answer goes."""

    prompts: list[list[int]]
    sampling: SamplingRequest
    answer: Future
    media: PromptMedia = None  # each prompt's pixel inputs (ServedPolicy.generate)


def group_key(s: SamplingRequest) -> SamplingRequest:
    """What requests of one batch must share: every sampling key but the seed."""
    return dataclasses.replace(s, seed=0)


class RequestBatcher:
    """Takes requests from any thread; a worker thread samples them in groups of at most
    max_rows prompts (serve.max_batch)."""

    def __init__(self, policy: ServedPolicy, window_s: float, max_rows: int):
        self.policy, self.window_s, self.max_rows = policy, window_s, max_rows
        self.waiting: queue.Queue[Waiting] = queue.Queue()
        self.held: Waiting | None = None  # came within a window but did not fit: next batch
        self.requests = self.batches = 0  # so far, for /health: requests per generate call
        self.worker = threading.Thread(target=self._serve, name="request-batcher", daemon=True)
        self.worker.start()

    def generate(
        self, prompts: list[list[int]], s: SamplingRequest, media: PromptMedia = None
    ) -> dict:
        """ServedPolicy.generate(prompts, s, media=media)'s answer, sampled with whatever
        else came within the window."""
        self.policy.checked_stops(prompts, s)  # a bad request fails alone, not its group
        self.policy.row_media(prompts, media)
        answer: Future = Future()
        self.waiting.put(Waiting(prompts, s, answer, media))
        return answer.result()

    def _serve(self) -> None:
        while True:
            for group in self._groups(self._collect()):
                self._sample(group)

    def _collect(self) -> list[Waiting]:
        """The first request to come and the others that come within the window after it,
        while they fit in max_rows prompts."""
        first, self.held = self.held or self.waiting.get(), None
        batch, rows = [first], len(first.prompts)
        deadline = time.monotonic() + self.window_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                more = self.waiting.get(timeout=left)
            except queue.Empty:
                break
            if rows + len(more.prompts) > self.max_rows:
                self.held = more
                break
            batch.append(more)
            rows += len(more.prompts)
        return batch

    @staticmethod
    def _groups(batch: list[Waiting]) -> list[list[Waiting]]:
        """The batch split by group_key, in the order each key first came."""
        groups: dict[SamplingRequest, list[Waiting]] = {}
        for w in batch:
            groups.setdefault(group_key(w.sampling), []).append(w)
        return list(groups.values())

    def _sample(self, group: list[Waiting]) -> None:
        """One generate call for the group; each request gets its rows, or the error."""
        self.requests, self.batches = self.requests + len(group), self.batches + 1
        prompts = [p for w in group for p in w.prompts]
        seeds = [(w.sampling.seed, len(w.prompts)) for w in group]
        media = None
        if any(w.media for w in group):
            media = [m for w in group for m in (w.media or [None] * len(w.prompts))]
        try:
            got = self.policy.generate(prompts, group[0].sampling, seeds, media)
        except Exception as e:  # BadRequest, Unavailable, ...: each request answers with it
            for w in group:
                w.answer.set_exception(e)
            return
        start = 0
        for w in group:
            rows = slice(start, start + len(w.prompts))
            w.answer.set_result({k: (v if k == "version" else v[rows]) for k, v in got.items()})
            start = rows.stop
