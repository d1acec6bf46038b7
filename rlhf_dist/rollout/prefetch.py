"""One-step-off-policy rollouts from the rollout servers (ppo.max_staleness=1;
docs/serving.md, "Asynchronous rollouts").

`PrefetchingServer` has the face collect.py samples through (load_weights, generate,
sleep) and wraps the `ServerEngine`. At iteration k, generate(): wait for the rollout
requested during iteration k-1 (sampled by the weights the trainer started k-1 with),
sync the trainer's current weights to the servers (they are idle now: a sync never
changes weights under a running request), then request iteration k+1's prompts on a
background thread and return iteration k's rollout. Scoring and the update of iteration
k run on the main thread while the servers sample k+1. The background thread only does
HTTP; every collective (the ranks' agreement on failures, the sync's gathers) stays on
the main thread.

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

import torch

from rlhf_dist.config import GenerationConfig
from rlhf_dist.rollout.server import ServerEngine


@dataclass
class InFlight:
    """A rollout requested from the servers: its prompts (B, P) and their mask, the
    answers to come ([(url, answer)] with the request's seconds), the iteration whose
    weights the servers held (`sampled_at`) and their policy version."""

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

    def __init__(self, server: ServerEngine, max_staleness: int):
        self.server, self.max_staleness = server, max_staleness
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-request")
        self.in_flight: InFlight | None = None
        self.iteration = 0  # the iteration about to sample (expect)
        self.upcoming: tuple[torch.Tensor, torch.Tensor] | None = None
        self.actor: torch.nn.Module | None = None
        self.dropped = 0  # rollouts dropped for staleness, this run
        # the last rollout handed out: its staleness (updates), version, request seconds
        self.staleness, self.version, self.request_seconds = 0, 0, 0.0

    def expect(self, iteration: int, upcoming: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Before iteration `iteration`: the prompts (ids, mask) of the next one, to request
        once this one's weights are synced (None: request nothing ahead; the last
        iteration, or one that writes a checkpoint)."""
        self.iteration, self.upcoming = iteration, upcoming

    def load_weights(self, actor: torch.nn.Module) -> None:
        """Keep the actor to sync in `generate`, after the rollout in flight is back."""
        self.actor = actor

    def sleep(self) -> None:
        """Nothing to free in this process: the engine lives in the servers."""

    def close(self) -> None:
        """Stop waiting for a request in flight (the run ends); HTTP timeouts bound it."""
        self.pool.shutdown(wait=False, cancel_futures=True)

    def generate(self, prompt_ids, prompt_mask, gen_cfg: GenerationConfig, stop_ids, pad_id: int):
        """This iteration's rollout of the prompts (B, P) -> (response_ids (B, T),
        sampler_logprobs (B, T)), as ServerEngine.generate; requests the next iteration's
        prompts before it returns. Another call (held-out evaluation) samples its prompts
        with the current weights and leaves the rollout in flight for its iteration."""
        ready = self._collect(prompt_ids, prompt_mask)
        assert self.actor is not None, "load_weights comes first (collect.py)"
        self.server.load_weights(self.actor)  # the servers are idle: nothing in flight
        synced = (self.iteration, self.server.version)
        if ready is not None and self.iteration - ready.sampled_at > self.max_staleness:
            self.dropped, ready = self.dropped + 1, None  # never trained on
        if ready is None:  # on-policy: the first iteration, after a checkpoint, evaluation
            ready = self._request(prompt_ids, prompt_mask, gen_cfg, stop_ids, synced)
        out = self._responses(ready, pad_id, prompt_ids.device)
        if self.upcoming is not None and self.in_flight is None:  # once per iteration
            ids, mask = self.upcoming
            self.in_flight = self._request(ids, mask, gen_cfg, stop_ids, synced)
            self.upcoming = None
        return out

    def _collect(self, prompt_ids, prompt_mask) -> InFlight | None:
        """The rollout in flight when it is these prompts' (taken out of the slot), else
        None; either way the servers have answered it when this returns."""
        held = self.in_flight
        if held is None:
            return None
        self.server.together(held.answers.result)  # a failure stops every rank together
        if not held.matches(prompt_ids, prompt_mask):
            return None
        self.in_flight = None
        return held

    def _request(self, prompt_ids, prompt_mask, gen_cfg, stop_ids, synced) -> InFlight:
        """Ask the servers for these prompts on the background thread (seeds drawn here)."""
        ask = self.server.request(prompt_ids, prompt_mask, gen_cfg, stop_ids)
        future = self.pool.submit(_timed, ask)
        return InFlight(prompt_ids, prompt_mask, future, *synced)

    def _responses(self, ready: InFlight, pad_id: int, device):
        """Wait for `ready` on every rank together -> its padded tensors; records its
        staleness, version and request seconds for the statistics."""
        answers, seconds = self.server.together(ready.answers.result)
        out = self.server.together(
            lambda: self.server.responses(answers, ready.version, pad_id, device)
        )
        self.staleness = self.iteration - ready.sampled_at
        self.version, self.request_seconds = ready.version, seconds
        return out
