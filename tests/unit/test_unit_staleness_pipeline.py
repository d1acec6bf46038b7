"""ppo.max_staleness = k > 1 (generation/prefetch.py, trainers/ppo/rollout.py): which
iterations are requested ahead of which, never across a scheduled checkpoint; with one
trainer process the syncs queued behind the requests (deferred), so iteration i trains what
the weights of iteration max(1, i - k) sampled, exactly, while the servers never wait for a
sync; the drained variant (several ranks) samples the same; the lengths sampled and trained.
A stand-in for the servers whose "weights" are one number the response echoes."""

import dataclasses
import threading

import torch

from rlhf_dist.config import Config, GenerationConfig
from rlhf_dist.generation.prefetch import (
    LengthTally,
    PrefetchingServer,
    response_lengths,
    server_all_max,
)
from rlhf_dist.generation.server import ServerEngine
from rlhf_dist.rollout.batch import PromptBatch
from rlhf_dist.trainers.ppo.prompts import with_ahead
from rlhf_dist.trainers.ppo.rollout import requested_through

PAD = 0


class EchoServers(ServerEngine):
    """One "server" holding the weight of the actor synced last: a response is [weight,
    first prompt token, ...], 2 + token % 7 tokens long (so the lengths vary). Records the thread of every sync and request."""

    def __init__(self):  # no HTTP, no weight-sync group
        self.version, self.weight, self.urls, self.threads = 0, -1, ["fake"], []
        self.any_rank = lambda flag: flag

    def load_weights(self, actor):
        self.threads.append(("sync", threading.current_thread().name))
        self.version += 1
        self.weight = int(actor.weight.item())

    def request(self, prompt_ids, prompt_mask, gen_cfg, stop_ids):
        def ask():
            self.threads.append(("request", threading.current_thread().name))
            rows = [[self.weight] + [int(r[-1])] * (1 + int(r[-1]) % 7) for r in prompt_ids]
            logprobs = [[-0.5] * len(r) for r in rows]
            return [("fake", {"version": self.version, "responses": rows, "logprobs": logprobs})]

        return ask


def prompts(first: int) -> PromptBatch:
    ids = torch.tensor([[first], [first + 1]])
    return PromptBatch(ids, torch.ones_like(ids), [f"q{first}", f"q{first + 1}"])


def config(k: int, iterations: int, every: int) -> Config:
    cfg = Config()
    return dataclasses.replace(
        cfg,
        ppo=dataclasses.replace(cfg.ppo, max_staleness=k, iterations=iterations),
        run=dataclasses.replace(cfg.run, checkpoint_every=every),
    )


def run_loop(engine: PrefetchingServer, cfg: Config) -> list[tuple[int, int]]:
    """The trainer's loop as recipe.py drives the sampler: before iteration it, name the
    iterations to request ahead (rollout.expect_next's rule), set the actor's weight to
    `it` (the weights iteration it starts with), sync, take the rollout. -> [(the weight
    that sampled iteration it's rollout, its staleness)]."""
    n, k = cfg.ppo.iterations, cfg.ppo.max_staleness
    batches = [prompts(10 * i) for i in range(1, n + 1)]
    actor, seen = torch.nn.Linear(1, 1, bias=False), []
    for it, (batch, ahead) in enumerate(with_ahead(iter(batches), max(k, 1)), start=1):
        engine.expect(it, None)
        first = max(it, requested_through(cfg, it - 1)) + 1
        for later in range(first, requested_through(cfg, it) + 1):
            engine.expect(it, ahead[later - it - 1])
        with torch.no_grad():
            actor.weight.fill_(float(it))
        engine.load_weights(actor)
        ids, _ = engine.generate(batch.ids, batch.mask, GenerationConfig(), (1,), PAD)
        assert ids[:, 1].tolist() == batch.ids[:, 0].tolist()  # this iteration's prompts
        seen.append((int(ids[0, 0]), engine.staleness))
    return seen


def test_requested_through_stops_at_scheduled_checkpoints_and_the_last_iteration():
    cfg = config(4, iterations=10, every=5)
    assert [requested_through(cfg, i) for i in range(0, 11)] == [
        0,
        5,
        5,
        5,
        5,
        5,
        10,
        10,
        10,
        10,
        10,
    ]
    off = config(4, iterations=10, every=0)  # no checkpoints: k ahead up to the last
    assert [requested_through(off, i) for i in range(1, 11)] == [5, 6, 7, 8, 9, 10, 10, 10, 10, 10]
    one = config(1, iterations=4, every=2)  # k = 1 as before: 2 then 4 ahead, 3 on-policy
    assert [requested_through(one, i) for i in range(1, 5)] == [2, 2, 4, 4]


def test_with_ahead_gives_the_next_depth_items():
    assert list(with_ahead(iter("abcd"), 2)) == [
        ("a", ["b", "c"]), ("b", ["c", "d"]), ("c", ["d"]), ("d", []),
    ]  # fmt: skip


def test_deferred_k4_trains_exactly_the_weights_of_iteration_i_minus_k_on_the_worker():
    cfg = config(4, iterations=12, every=6)
    servers = EchoServers()
    engine = PrefetchingServer(servers, 4, deferred=True)
    seen = run_loop(engine, cfg)
    engine.pool.shutdown(wait=True)  # the last sync runs after the last rollout it needs
    # sampled by the weights of iteration max(c + 1, i - k), c the last checkpoint before i
    expected = [max(1 if i <= 6 else 7, i - 4) for i in range(1, 13)]
    assert [w for w, _ in seen] == expected
    assert [s for _, s in seen] == [i - w for i, w in zip(range(1, 13), expected)]
    assert max(s for _, s in seen) == 4
    # every sync and request ran on the worker, in the order the loop queued them
    assert {name for _, name in servers.threads} == {"rollout-request_0"}
    assert sum(kind == "sync" for kind, _ in servers.threads) == 12


def test_drained_k4_samples_what_the_deferred_one_does():
    cfg = config(4, iterations=9, every=0)
    deferred = run_loop(PrefetchingServer(EchoServers(), 4, deferred=True), cfg)
    drained = run_loop(PrefetchingServer(EchoServers(), 4, deferred=False), cfg)
    assert deferred == drained == [(max(1, i - 4), min(i - 1, 4)) for i in range(1, 10)]


def test_a_deferred_sync_that_fails_fails_the_requests_behind_it():
    servers = EchoServers()
    engine = PrefetchingServer(servers, 2, deferred=True)
    broken = RuntimeError("weight broadcast to the rollout servers failed")

    def fail(actor):
        raise broken

    servers.load_weights = fail
    engine.expect(1, None)
    engine.load_weights(torch.nn.Linear(1, 1, bias=False))
    batch = prompts(10)
    try:
        engine.generate(batch.ids, batch.mask, GenerationConfig(), (1,), PAD)
    except RuntimeError as e:
        assert e is broken
    else:
        raise AssertionError("a request sampled after a failed sync")


def test_sampled_and_trained_lengths_count_the_dropped_rollouts_as_sampled_only():
    servers = EchoServers()
    engine = PrefetchingServer(servers, 1, deferred=False)
    actor = torch.nn.Linear(1, 1, bias=False)
    engine.expect(1, prompts(20))  # lengths 2 + 20 % 7 = 8 and 2 + 21 % 7 = 2
    engine.load_weights(actor)
    batch = prompts(10)  # lengths 2 + 3 = 5 and 2 + 4 = 6
    engine.generate(batch.ids, batch.mask, GenerationConfig(), (1,), PAD)
    assert engine.lengths.now == [11.0, 2.0, 11.0, 2.0]
    engine.queue[0].answers.result(10)
    engine.expect(3, None)  # two updates later: iteration 2's rollout is too stale
    engine.load_weights(actor)
    again = prompts(20)
    engine.generate(again.ids, again.mask, GenerationConfig(), (1,), PAD)
    assert engine.dropped == 1
    # this iteration: the dropped 8 + 2 sampled, its fresh 8 + 2 sampled and trained
    assert engine.lengths.now == [20.0, 4.0, 10.0, 2.0]


class Ranks:
    """The part of Runtime the prefetcher's statistics read, for `world` ranks that all
    hold the same tally (all_sum multiplies by the world)."""

    def __init__(self, world: int):
        self.world_size = world

    def all_sum(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.world_size

    def all_max(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_lengths_metrics_and_when_syncs_are_deferred():
    tally = LengthTally([0.0] * 4)
    assert response_lengths(Ranks(2), tally) == {}  # endpoint episodes: no lengths
    tally.add([("url", {"responses": [[1, 2, 3], [4]]})], trained=True)
    tally.add([("url", {"responses": [[1] * 6]})], trained=False)
    tally.add([object()], trained=True)  # an episode: not counted here
    assert response_lengths(Ranks(2), tally) == {
        "async/sampled_len_mean": 10 / 3, "async/trained_len_mean": 2.0,
        "async/sampled_rows": 6.0, "async/trained_rows": 4.0,
    }  # fmt: skip
    one, two = Ranks(1), Ranks(2)
    assert server_all_max(one, 4)[1] and server_all_max(one, 4)[0](torch.tensor(3.0)) == 3.0
    assert not server_all_max(one, 1)[1]  # k = 1 stays drained, as before
    assert not server_all_max(two, 4)[1]  # several ranks: the collectives stay on main
