"""Kill and resume with ppo.partial_rollouts (k = 2) against one real `rlhf-dist serve`
process: a trainer stopped mid-generation (iteration 4's rollout being decoded while
iteration 3's update trains), mid-update (after the first of iteration 3's two optimizer
steps) or mid-sync (after the first bucket of iteration 3's weight sync, on the sync
worker: the server is left holding a torn, never swapped-in update) is resumed with
run.resume=auto from iteration 2's checkpoint. Partial rollouts are not reproduced bit
for bit, so the test counts instead: every iteration is logged once, and every row of
the schedule (each prompt of each iteration's global batch, samples_per_prompt times)
was trained exactly once, by its prompt index in samples.jsonl; nothing is dropped and
every rollout the resumed run requested was handed out once. The mid-generation kill is a
real `rlhf-dist ppo` process SIGKILLed by RLHF_DIST_FAULT; the other two are tests/faults.py's
in-process stand-ins for it (they also record what the prefetcher handed out)."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter

import pytest
from faults import Killed
from serve_process import served_tiny_policy

from rlhf_dist.config import config_from_dict

TOKEN = "test-token-partial-resume-93b1"
ENV = "RLHF_DIST_TEST_PARTIAL_RESUME_TOKEN"
ITERATIONS, PROMPTS, N = 4, 2, 4  # iterations, prompts per iteration, samples per prompt


@pytest.fixture(scope="module")
def server(task_env):
    """A `rlhf-dist serve` process of the tiny policy on a free port, shared by every kill
    point; its URL."""
    with served_tiny_policy(task_env.policy, ENV, TOKEN) as url:
        yield url


def _config(server, policy, out, task_env, data_cfg):
    return config_from_dict(
        {
            "run": {"output_dir": str(out), "seed": 0, "log_every": 1, "checkpoint_every": 2,
                    "samples_every": 1, "num_samples": PROMPTS * N},
            "model": {"policy": str(policy)},
            "data": data_cfg(train=str(task_env.files.prompts)),
            # small buckets: a sync is several broadcasts, so one can stop half-way
            "generation": {"max_new_tokens": 16, "temperature": 0.7, "backend": "server",
                           "server_urls": [server], "server_token_env": ENV,
                           "server_sync_bucket_mb": 0.05},
            "reward": {"function": "rlhf_dist.demo.task:positive_word_reward"},
            "ppo": {"iterations": ITERATIONS, "rollout_batch_size": PROMPTS,
                    "samples_per_prompt": N, "rollout_micro_batch_size": 8, "ppo_epochs": 1,
                    "minibatch_size": 4, "micro_batch_size": 4, "optim": {"lr": 1e-3},
                    "kl_coef": 0.0, "estimator": "grpo", "max_staleness": 2,
                    "partial_rollouts": True, "rollout_correction": "tis", "decoupled": True},
            "distributed": {"timeout_s": 60},
        }
    )  # fmt: skip


def _schedule(cfg) -> list[list[int]]:
    """Each iteration's global batch of prompt indices, as the trainer draws it."""
    from rlhf_dist.data.batching import global_batches
    from rlhf_dist.models import tokenizer_for
    from rlhf_dist.trainers.ppo.prompts import training_prompts

    n = len(training_prompts(cfg, tokenizer_for(cfg, "policy")).ids)
    batches = global_batches(n, PROMPTS, cfg.run.seed, epochs=10)
    return [idx for _, idx in itertools.islice(batches, ITERATIONS)]


def _assert_killed_after_iteration_2(run, read_jsonl) -> None:
    """Killed before iteration 3 was logged or checkpointed: the resume starts after 2."""
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-000002"


def _assert_trained_once(cfg, run, read_jsonl) -> None:
    """Every iteration logged once, nothing dropped, and every scheduled (iteration,
    prompt) trained N times by samples.jsonl's prompt index: no sample lost, none twice."""
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, ITERATIONS + 1))
    assert all(r["rollout/stale_dropped"] == 0 for r in rows)
    assert all(r["async/trained_rows"] == PROMPTS * N for r in rows)
    samples = read_jsonl(run / "samples.jsonl")
    trained = Counter((s["step"], s["prompt_index"]) for s in samples)
    wanted = Counter({(it, i): N for it, idx in enumerate(_schedule(cfg), start=1) for i in idx})
    assert trained == wanted


def test_partial_rollouts_sigkilled_mid_generation_train_every_sample_once(
    server, sft_run, task_env, tmp_path, data_cfg, read_jsonl
):
    """`rlhf-dist ppo` SIGKILLed (RLHF_DIST_FAULT) at iteration 3's rollout, iteration 4's
    partial rollout in flight on the server, then resumed by the same command with
    run.resume=auto from iteration 2's checkpoint."""
    import json
    import os
    import signal
    import subprocess
    import sys

    cfg = _config(server, sft_run.out / "final", tmp_path / "run", task_env, data_cfg)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(dataclasses.asdict(cfg)))

    def run(*extra: str, fault: str = "") -> subprocess.CompletedProcess:
        env = os.environ | {ENV: TOKEN, "OMP_NUM_THREADS": "1", "RLHF_DIST_FAULT": fault}
        cmd = [sys.executable, "-m", "rlhf_dist", "ppo", "--config", str(path), *extra]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)

    killed = run(fault="rollout:3")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    _assert_killed_after_iteration_2(tmp_path / "run", read_jsonl)
    resumed = run("run.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    _assert_trained_once(cfg, tmp_path / "run", read_jsonl)


@pytest.mark.parametrize(
    "module, point",
    [
        ("rlhf_dist.trainers.ppo.update", "update"),  # mid-update
        ("rlhf_dist.generation.server", "weight_sync"),  # mid-sync, on the sync worker
    ],
)
def test_partial_rollouts_killed_and_resumed_train_every_sample_once(
    module, point, server, sft_run, task_env, runtime, tmp_path, monkeypatch, data_cfg,
    read_jsonl,
):  # fmt: skip
    import importlib

    from rlhf_dist.generation import factory
    from rlhf_dist.generation.prefetch import PrefetchingServer
    from rlhf_dist.trainers.ppo import recipe as ppo_module

    monkeypatch.setenv(ENV, TOKEN)
    made: list[PrefetchingServer] = []
    submitted: list[list] = []
    handed: list[list] = []

    class Recorded(PrefetchingServer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)
            submitted.append([])
            handed.append([])

        def _submit(self, *args, **kwargs):
            submitted[-1].append(super()._submit(*args, **kwargs))
            return submitted[-1][-1]

        def _ready(self, *args, **kwargs):
            handed[-1].append(super()._ready(*args, **kwargs))
            return handed[-1][-1]

    monkeypatch.setattr(factory, "PrefetchingServer", Recorded)
    cfg = _config(server, sft_run.out / "final", tmp_path / "run", task_env, data_cfg)
    reached: list[int] = []

    def fault(at: str, n: int) -> None:  # at iteration 3, or its sync (the third)
        if at == point:
            reached.append(n)
            if n == 3:
                raise Killed

    with monkeypatch.context() as m:
        m.setattr(importlib.import_module(module), "maybe_fault", fault)
        with pytest.raises(Killed):
            ppo_module.train_ppo(cfg, runtime)
    assert reached[-1] == 3
    if point == "weight_sync":  # several buckets per sync: the kill left one half-sent
        assert reached.count(1) > 1
    _assert_killed_after_iteration_2(tmp_path / "run", read_jsonl)
    # SIGKILL ends the killed trainer's workers with it: here their queued work is cancelled
    made[-1].pool.shutdown(wait=True, cancel_futures=True)
    made[-1].sync_pool.shutdown(wait=True, cancel_futures=True)
    ppo_module.train_ppo(
        dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, resume="auto")), runtime
    )
    _assert_trained_once(cfg, tmp_path / "run", read_jsonl)
    # the resumed run (iterations 3 and 4) handed out each rollout it requested, once
    assert len(handed[-1]) == 2 and len({id(r) for r in handed[-1]}) == 2
    assert {id(r) for r in submitted[-1]} == {id(r) for r in handed[-1]}
    assert not made[-1].queue
