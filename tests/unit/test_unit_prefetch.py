"""generation/prefetch.py (ppo.max_staleness=1) against a stand-in for the servers: which weights
sample which iteration, what is requested ahead and on which thread, the staleness bound,
an evaluation between iterations, the version check, and episodes an environment plays
through the endpoint. The real servers: the integration tests in
tests/integration/test_integration_serve.py and test_integration_agent.py."""

import contextlib
import threading
import types

import pytest
import torch

from rlhf_dist.config import GenerationConfig
from rlhf_dist.errors import ServerError, UserError
from rlhf_dist.generation.prefetch import PrefetchingServer
from rlhf_dist.generation.server import ServerEngine
from rlhf_dist.rollout.batch import PromptBatch

PAD = 0


class FakeServers(ServerEngine):
    """One "server" whose weights are the version synced last: a response is
    [version, first prompt token]. A request can be held until released (`gate`), and
    every request records the thread it ran on."""

    def __init__(self):  # no HTTP, no weight-sync group
        self.version, self.urls, self.threads = 0, ["fake"], []
        self.gate = threading.Event()
        self.gate.set()
        self.answer_version: int | None = None  # a server that answers with another version
        self.any_rank = lambda flag: flag

    def load_weights(self, actor):
        self.version += 1

    def request(self, prompt_ids, prompt_mask, gen_cfg, stop_ids):
        version = self.version if self.answer_version is None else self.answer_version

        def ask():
            self.threads.append(threading.current_thread().name)
            assert self.gate.wait(10)
            rows = [[version, int(r[-1])] for r in prompt_ids]
            return [
                (
                    "fake",
                    {"version": version, "responses": rows, "logprobs": [[-0.5, -0.5]] * len(rows)},
                )
            ]

        return ask


def prompts(first: int) -> PromptBatch:
    ids = torch.tensor([[first], [first + 1]])
    return PromptBatch(ids, torch.ones_like(ids), [f"q{first}", f"q{first + 1}"])


def sample(engine: PrefetchingServer, batch: PromptBatch) -> list[list[int]]:
    engine.load_weights(torch.nn.Linear(1, 1))
    ids, _ = engine.generate(batch.ids, batch.mask, GenerationConfig(), (1,), PAD)
    return ids.tolist()


def test_each_iteration_trains_on_the_rollout_the_previous_weights_sampled():
    servers = FakeServers()
    engine = PrefetchingServer(servers, max_staleness=1)
    batches = [prompts(10 * i) for i in range(1, 5)]
    seen = []
    for it, batch in enumerate(batches, start=1):
        engine.expect(it, batches[it] if it < len(batches) else None)
        seen.append((sample(engine, batch), engine.staleness, engine.version))
    # iteration 1 sampled on-policy by version 1; iteration k > 1 by version k - 1, the
    # weights iteration k - 1 started with; iteration k synced version k before asking.
    assert seen[0] == ([[1, 10], [1, 11]], 0, 1)
    for k in (2, 3, 4):
        assert seen[k - 1] == ([[k - 1, 10 * k], [k - 1, 10 * k + 1]], 1, k - 1)
    assert servers.version == 4 and not engine.queue  # nothing asked after the last
    assert engine.dropped == 0
    # the rollouts asked ahead ran on the background thread, the first one too (waited for)
    assert all(name.startswith("rollout-request") for name in servers.threads)


def test_the_next_rollout_is_sampled_while_the_caller_goes_on():
    servers = FakeServers()
    engine = PrefetchingServer(servers, max_staleness=1)
    engine.expect(1, prompts(20))
    sample(engine, prompts(10))
    assert engine.queue
    engine.queue[0].answers.result(10)  # iteration 2's rollout is back
    servers.gate.clear()  # the servers now hold every request until released
    engine.expect(2, prompts(30))
    done = threading.Event()

    def iteration_two():
        sample(engine, prompts(20))  # iteration 2's rollout was sampled during iteration 1
        done.set()

    worker = threading.Thread(target=iteration_two)
    worker.start()
    assert done.wait(10), "iteration 2 waited for iteration 3's rollout"
    assert engine.queue and not engine.queue[0].answers.done()
    servers.gate.set()
    worker.join()


def test_no_request_ahead_leaves_the_next_iteration_on_policy():
    servers = FakeServers()
    engine = PrefetchingServer(servers, max_staleness=1)
    engine.expect(1, None)  # e.g. iteration 1 writes a checkpoint
    sample(engine, prompts(10))
    assert not engine.queue
    engine.expect(2, None)
    assert sample(engine, prompts(20)) == [[2, 20], [2, 21]] and engine.staleness == 0


def test_a_rollout_older_than_the_bound_is_dropped_and_sampled_again():
    servers = FakeServers()
    engine = PrefetchingServer(servers, max_staleness=1)
    engine.expect(1, prompts(20))
    sample(engine, prompts(10))  # asks iteration 2's prompts with version 1
    engine.expect(3, None)  # the loop skipped an iteration: that rollout is 2 updates old
    assert sample(engine, prompts(20)) == [[2, 20], [2, 21]]
    assert engine.dropped == 1 and engine.staleness == 0


def test_an_evaluation_between_iterations_keeps_the_rollout_in_flight():
    servers = FakeServers()
    engine = PrefetchingServer(servers, max_staleness=1)
    engine.expect(1, prompts(20))
    sample(engine, prompts(10))
    # held-out evaluation after iteration 1: its own prompts, the current weights (v2)
    assert sample(engine, prompts(90)) == [[2, 90], [2, 91]]
    assert engine.queue  # iteration 2's rollout still waits for it
    engine.expect(2, None)
    assert sample(engine, prompts(20)) == [[1, 20], [1, 21]] and engine.staleness == 1


def test_an_answer_from_another_version_is_an_error():
    servers = FakeServers()
    servers.answer_version = 7
    engine = PrefetchingServer(servers, max_staleness=1)
    engine.expect(1, None)
    with pytest.raises(ServerError, match="sampled with policy version 7, the trainer synced"):
        sample(engine, prompts(10))


def test_episodes_are_played_one_step_ahead_like_a_rollout():
    """generation.environment_endpoint with ppo.max_staleness=1: iteration k's episodes
    were played by the weights iteration k-1 started with, iteration k+1's start as k's are
    handed out, on the background thread; the episodes are named on the caller's thread
    (`play(batch)` runs there) and an environment's error reaches the caller."""
    servers = FakeServers()
    engine = PrefetchingServer(servers, max_staleness=1)
    named_on, played = [], []

    def play(batch: PromptBatch):
        named_on.append(threading.current_thread().name)
        version = servers.version

        def work():
            played.append(threading.current_thread().name)
            return [(t, version) for t in batch.texts]

        return work

    batches = [prompts(10 * i) for i in range(1, 4)]
    seen = []
    for it, batch in enumerate(batches, start=1):
        engine.expect(it, batches[it] if it < len(batches) else None)
        engine.load_weights(torch.nn.Linear(1, 1))
        seen.append((engine.episodes(batch, play), engine.staleness, engine.version))
    assert seen[0] == ([("q10", 1), ("q11", 1)], 0, 1)
    assert seen[1] == ([("q20", 1), ("q21", 1)], 1, 1)
    assert seen[2] == ([("q30", 2), ("q31", 2)], 1, 2)
    assert set(named_on) == {threading.current_thread().name}
    assert played and all(name.startswith("rollout-request") for name in played)

    def failing(batch: PromptBatch):
        def work():
            raise UserError("generation.environment: episode 0 raised ValueError: no")

        return work

    engine.expect(4, None)
    engine.load_weights(torch.nn.Linear(1, 1))
    with pytest.raises(UserError, match="episode 0 raised ValueError"):
        engine.episodes(prompts(40), failing)


def test_through_the_sampler_protocol_rows_carry_the_version_that_sampled_them():
    """sync / expect_next / sample / stats / servers: the Sampler face of the prefetcher
    (generation/base.py), as collect.py and the trainer call it."""
    servers = FakeServers()
    servers.weights = lambda: contextlib.nullcontext((torch.nn.Linear(1, 1), None))
    engine = PrefetchingServer(servers, max_staleness=1)
    assert not engine.from_actor and engine.in_step and engine.servers() is servers
    batches, gen = [prompts(10), prompts(20)], GenerationConfig()
    versions = []
    for it, batch in enumerate(batches, start=1):
        engine.expect_next(it, batches[it] if it < len(batches) else None)
        engine.sync(batch.ids, batch.mask, gen, (1,), None)
        samples = engine.sample(batch.ids, batch.mask, gen, (1,), PAD)
        assert samples.logprobs is not None and samples.logprobs.shape == (2, 2)
        versions.append(samples.versions.tolist())
    # iteration 2 was sampled ahead by version 1, while version 2 trained
    assert versions == [[1, 1], [1, 1]] and servers.version == 2
    runtime = types.SimpleNamespace(all_max=lambda x: x, all_sum=lambda x: x, world_size=1)
    servers.sync_gap, servers.sync_peak_bytes, servers.sync_seconds = 0.0, 0, 0.0
    stats = engine.stats(runtime)
    assert stats["rollout/policy_version"] == 1.0 and stats["rollout/staleness_max"] == 1.0
