"""Entropy control's choice of tokens (trainers/ppo/entropy.py, stats.global_top_k) on a
simulated world of 1, 2 and 4 ranks in one process.

`ThreadWorld` runs each rank in a thread; its all_sum / all_max stack every rank's tensor
(in rank order) and reduce, as gloo does. The choice must be the same tokens however the
rollout's rows are spread over ranks: the rule that keeps the loss split-invariant
(docs/architecture.md section 4). The gradient side is tested in
tests/integration/test_integration_entropy.py and on real ranks in
tests/distributed/test_dist_split_invariance.py.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch

from rlhf_dist.algo.entropy import selection_count, token_covariance
from rlhf_dist.config import config_from_dict
from rlhf_dist.rollout import RolloutBatch
from rlhf_dist.stats import global_top_k
from rlhf_dist.trainers.ppo.entropy import cov_choice


class ThreadWorld:
    """n ranks, one thread each, whose collectives meet at a barrier."""

    def __init__(self, n: int):
        self.n = n
        self.barrier = threading.Barrier(n, timeout=30)
        self.slots: list = [None] * n

    def run(self, fn) -> list:
        """fn(runtime) on every rank at once; the results in rank order."""
        results, errors = [None] * self.n, []

        def target(rank):
            try:
                results[rank] = fn(Rank(self, rank))
            except BaseException as e:  # re-raised below, in the test's thread
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=target, args=(r,)) for r in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


class Rank:
    device = torch.device("cpu")

    def __init__(self, world: ThreadWorld, rank: int):
        self.world, self.rank, self.world_size = world, rank, world.n

    def _reduce(self, x: torch.Tensor, op) -> torch.Tensor:
        w = self.world
        w.slots[self.rank] = x.detach().clone()
        w.barrier.wait()
        out = op(torch.stack(w.slots))
        w.barrier.wait()  # every rank has read before the next collective writes
        return out.to(x.dtype)

    def all_sum(self, x):
        return self._reduce(x, lambda s: s.sum(0))

    def all_max(self, x):
        return self._reduce(x, lambda s: s.amax(0))


def rollout(seed: int, B: int = 16, T: int = 12):
    """A rollout of B rows with ragged responses, its old log-probs and advantages."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    zeros = torch.zeros(B, T)
    batch = RolloutBatch(
        prompt_ids=torch.ones(B, 3, dtype=torch.long),
        prompt_mask=torch.ones(B, 3, dtype=torch.long),
        response_ids=torch.ones(B, T, dtype=torch.long),
        response_mask=mask,
        old_logprobs=torch.where(mask, -torch.rand(B, T, generator=g) * 4, 0.0),
        ref_logprobs=zeros,
        old_values=None,
        scores=torch.zeros(B),
        raw_scores=torch.zeros(B),
        finished=torch.ones(B, dtype=torch.bool),
        entropy=zeros,
    )
    return batch, torch.where(mask, torch.randn(B, T, generator=g) * 1.5, 0.0)


def ppo_section(**keys):
    tree = {"model": {"policy": "/p"}, "data": {"train": "/d"}, "ppo": keys}
    return config_from_dict(tree).ppo


def choose_on(world_size: int, batch, advantages, p, seed=0, it=3):
    """Every rank's (chosen tokens, statistics) for its contiguous share of the rows."""
    B = batch.response_mask.shape[0]
    per = B // world_size

    def on_rank(runtime):
        rows = slice(runtime.rank * per, (runtime.rank + 1) * per)
        return cov_choice(runtime, batch.select(rows), advantages[rows], p, seed, it)

    return ThreadWorld(world_size).run(on_rank)


@pytest.mark.parametrize("method", ["clip_cov", "kl_cov"])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_choice_is_the_same_tokens_on_1_2_and_4_ranks(method, seed):
    batch, adv = rollout(seed)
    p = ppo_section(cov_control=method, cov_ratio=0.05, cov_clip_low=0.2, cov_clip_high=3.0)
    (one,) = choose_on(1, batch, adv, p, seed)
    chosen, stats = one
    n = int(batch.response_mask.sum())
    k = selection_count(0.05, n)
    assert int(chosen.sum()) == k >= 2  # enough candidates for k here
    assert stats["entropy/cov_chosen_frac"] == pytest.approx(k / n)
    for world_size in (2, 4):
        parts = choose_on(world_size, batch, adv, p, seed)
        assert torch.equal(torch.cat([c for c, _ in parts]), chosen), world_size
        for _, s in parts:  # every rank logs the global figures
            assert s.keys() == stats.keys()
            for name, value in stats.items():
                assert s[name] == pytest.approx(value, rel=1e-12), name
    # What was chosen: KL-Cov the k largest covariances over the WHOLE batch; Clip-Cov
    # candidates inside the bounds, k of them.
    mask = batch.response_mask
    cov = token_covariance(
        batch.old_logprobs, adv, mask, batch.old_logprobs[mask].mean(), adv[mask].mean()
    )
    if method == "kl_cov":
        assert cov[chosen].min() >= cov[mask & ~chosen].max()
    else:
        assert ((cov[chosen] > 0.2) & (cov[chosen] < 3.0)).all()
        inside = mask & (cov > 0.2) & (cov < 3.0)
        assert stats["entropy/cov_candidate_frac"] == pytest.approx(int(inside.sum()) / n)
    assert stats["entropy/cov_mean"] == pytest.approx(float(cov[mask].mean()), rel=1e-9)


def test_clip_cov_draws_other_tokens_at_another_iteration_and_off_is_none():
    batch, adv = rollout(5)
    p = ppo_section(cov_control="clip_cov", cov_ratio=0.05, cov_clip_low=0.0, cov_clip_high=9.0)
    ((first, _),) = choose_on(1, batch, adv, p, it=1)
    ((again, _),) = choose_on(1, batch, adv, p, it=1)
    ((other, _),) = choose_on(1, batch, adv, p, it=2)
    assert torch.equal(first, again) and not torch.equal(first, other)
    ((off, stats),) = choose_on(1, batch, adv, ppo_section())
    assert off is None and stats == {}


def test_fewer_candidates_than_k_chooses_them_all():
    batch, adv = rollout(2)
    # A band that holds only a few tokens, and a share asking for more than that.
    p = ppo_section(cov_control="clip_cov", cov_ratio=0.1, cov_clip_low=2.5, cov_clip_high=9.0)
    ((chosen, stats),) = choose_on(1, batch, adv, p)
    n = int(batch.response_mask.sum())
    assert 0 < int(chosen.sum()) < selection_count(0.1, n)
    assert stats["entropy/cov_chosen_frac"] == pytest.approx(stats["entropy/cov_candidate_frac"])
    assert torch.equal(torch.cat([c for c, _ in choose_on(2, batch, adv, p)]), chosen)


def test_global_top_k_by_hand_and_on_uneven_ranks():
    values = [
        torch.tensor([3.0, -1.0, 7.0]),
        torch.tensor([5.0]),
        torch.tensor([]),
        torch.tensor([6.0, 2.0]),
    ]
    out = ThreadWorld(4).run(lambda rt: global_top_k(rt, values[rt.rank], 3))
    for top in out:  # every rank gets the world's 3 largest, in order
        assert top.tolist() == [7.0, 6.0, 5.0]
    # More places than values: -inf fills them.
    (alone,) = ThreadWorld(1).run(lambda rt: global_top_k(rt, values[3], 4))
    assert alone.tolist() == [6.0, 2.0, -math.inf, -math.inf]
