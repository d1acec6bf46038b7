"""Concurrent one-prompt requests sampled as one batch (serve.batch_window_ms; docs/serving.md,
"Batching concurrent requests").

An environment that drives the policy through the OpenAI-compatible endpoints sends one
request per episode turn, many episodes at once (generation.endpoint_episodes_at_once).
Served one at a time, each decode step of a one-row batch reads every weight for one
token. Here a request waits up to the window for others with the same sampling keys, and
the group is decoded together: every row with its own seed's generator
(ServedPolicy.generate `seeds`), so each row draws what it would draw alone. Its tokens
and log-probs are the one-at-a-time ones up to the float rounding of a forward at another
batch shape (a near-tie can then break the other way): reproducible within that, not bit
for bit, which is why the window is 0 (off) by default.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from concurrent.futures import Future

from rlhf_dist.serving.policy import SamplingRequest, ServedPolicy


@dataclasses.dataclass
class Waiting:
    """One request: its prompt, its sampling keys and where its answer goes."""

    prompt: list[int]
    sampling: SamplingRequest
    answer: Future


def group_key(s: SamplingRequest) -> SamplingRequest:
    """What rows of one batch must share: every sampling key but the seed."""
    return dataclasses.replace(s, seed=0)


class RequestBatcher:
    """Takes one-prompt requests from any thread; a worker thread samples them in groups."""

    def __init__(self, policy: ServedPolicy, window_s: float, max_batch: int):
        self.policy, self.window_s, self.max_batch = policy, window_s, max_batch
        self.waiting: queue.Queue[Waiting] = queue.Queue()
        self.worker = threading.Thread(target=self._serve, name="request-batcher", daemon=True)
        self.worker.start()

    def generate(self, prompt: list[int], s: SamplingRequest) -> dict:
        """ServedPolicy.generate([prompt], s)'s answer, sampled with whatever else came
        within the window."""
        self.policy.checked_stops([prompt], s)  # a bad request fails alone, not its group
        answer: Future = Future()
        self.waiting.put(Waiting(prompt, s, answer))
        return answer.result()

    def _serve(self) -> None:
        while True:
            for group in self._groups(self._collect()):
                self._sample(group)

    def _collect(self) -> list[Waiting]:
        """The first request to come, and the others that come within the window after it
        (at most max_batch in all)."""
        batch = [self.waiting.get()]
        deadline = time.monotonic() + self.window_s
        while len(batch) < self.max_batch:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                batch.append(self.waiting.get(timeout=left))
            except queue.Empty:
                break
        return batch

    @staticmethod
    def _groups(batch: list[Waiting]) -> list[list[Waiting]]:
        """The batch split by group_key, in the order each key first came."""
        groups: dict[SamplingRequest, list[Waiting]] = {}
        for w in batch:
            groups.setdefault(group_key(w.sampling), []).append(w)
        return list(groups.values())

    def _sample(self, group: list[Waiting]) -> None:
        """One generate call for the group; each request gets its row, or the error."""
        try:
            got = self.policy.generate(
                [w.prompt for w in group], group[0].sampling, [w.sampling.seed for w in group]
            )
        except Exception as e:  # BadRequest, Unavailable, ...: each request answers with it
            for w in group:
                w.answer.set_exception(e)
            return
        for i, w in enumerate(group):
            w.answer.set_result({k: (v if k == "version" else [v[i]]) for k, v in got.items()})
