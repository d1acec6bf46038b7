"""ppo.partial_rollouts with ppo.max_staleness = 4 against a real `rlhf-dist serve` process
(generation/prefetch.py: the deferred syncs on a worker of their own, beside the requests;
serving/partial.py on the server): every rollout requested is trained exactly once, each
token carries the version that sampled it (non-decreasing along a row, never older than
the sync before its request), the token staleness is logged and the actor trains. Where an
update lands inside a response depends on timing; serve_partial's unit tests force one."""

from __future__ import annotations

import pytest
import torch
from serve_process import served

from rlhf_dist.config import config_from_dict

TOKEN = "test-token-partial-7c1e"
ENV = "RLHF_DIST_TEST_PARTIAL_TOKEN"


@pytest.fixture(scope="module")
def server(task_env):
    """A `rlhf-dist serve` process of the tiny policy on a free port; its URL."""
    tree = {"model": {"policy": str(task_env.policy)}, "serve": {"max_batch": 16},
            "perf": {"num_threads": 1}, "distributed": {"timeout_s": 60}}  # fmt: skip
    with served(tree, ENV, TOKEN) as url:
        yield url


def test_partial_rollouts_train_every_rollout_once_with_per_token_versions(
    server, sft_run, task_env, runtime, tmp_path, monkeypatch, data_cfg, read_jsonl,
    saved_state_dict,
):  # fmt: skip
    from rlhf_dist.generation import factory
    from rlhf_dist.generation.prefetch import PrefetchingServer
    from rlhf_dist.trainers.ppo import recipe as ppo_module

    monkeypatch.setenv(ENV, TOKEN)
    submitted, handed, versions = [], [], []

    class Recorded(PrefetchingServer):
        def _submit(self, *args, **kwargs):
            submitted.append(super()._submit(*args, **kwargs))
            return submitted[-1]

        def _ready(self, *args, **kwargs):
            handed.append(super()._ready(*args, **kwargs))
            return handed[-1]

        def sample(self, *args, **kwargs):
            got = super().sample(*args, **kwargs)
            versions.append((got.versions, self.server.checked_version))
            return got

    monkeypatch.setattr(factory, "PrefetchingServer", Recorded)
    policy = sft_run.out / "final"
    cfg = config_from_dict(
        {
            "run": {"output_dir": str(tmp_path / "run"), "seed": 0, "log_every": 1},
            "model": {"policy": str(policy)},
            "data": data_cfg(train=str(task_env.files.prompts)),
            "generation": {"max_new_tokens": 16, "temperature": 0.7, "backend": "server",
                           "server_urls": [server], "server_token_env": ENV},
            "reward": {"function": "rlhf_dist.demo.task:positive_word_reward"},
            "ppo": {"iterations": 6, "rollout_batch_size": 2, "samples_per_prompt": 4,
                    "rollout_micro_batch_size": 8, "ppo_epochs": 1, "minibatch_size": 8,
                    "micro_batch_size": 8, "optim": {"lr": 1e-3}, "kl_coef": 0.0,
                    "estimator": "grpo", "max_staleness": 4, "partial_rollouts": True,
                    "rollout_correction": "tis", "decoupled": True},
            "distributed": {"timeout_s": 60},
        }
    )  # fmt: skip
    ppo_module.train_ppo(cfg, runtime)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 7))
    # no rollout lost or trained twice: each one requested was handed out once
    assert len(handed) == 6 and len({id(r) for r in handed}) == 6
    assert {id(r) for r in submitted} == {id(r) for r in handed}
    assert all(r["rollout/stale_dropped"] == 0 and r["async/trained_rows"] == 8 for r in rows)
    for got, synced in versions:
        assert got.shape[0] == 8 and got.dim() == 2  # (B, T): per token
        for row in got.tolist():
            real = [v for v in row if v >= 0]
            assert real and real[0] >= 1 and real == sorted(real)  # never version 0's weights
        assert int(got.max()) <= synced + 4
    for r in rows:
        low, mean, high = (r[f"rollout/token_staleness_{s}"] for s in ("min", "mean", "max"))
        assert 0 <= low <= mean <= high <= 5
        assert 0 <= r["rollout/version_switched_rows"] <= 1
    before, after = saved_state_dict(policy), saved_state_dict(tmp_path / "run" / "final")
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the actor trained
