"""ppo.max_staleness = 4 against a real `rlhf-dist serve` process (generation/prefetch.py,
deferred syncs: one trainer process): iteration i trains what the weights of iteration
max(c + 1, i - 4) sampled, c the last scheduled checkpoint, so the staleness climbs 0..4
between checkpoints; a trainer killed at iteration 8's rollout with iterations 9 and 10 in
flight resumes from iteration 5's checkpoint to the unbroken run's metrics, bitwise (the
servers' version counter aside), in process and as a real `rlhf-dist ppo` process
SIGKILLed there (slow); the sampled and trained lengths are logged. The
objective is the decoupled one (ppo.decoupled, its behaviour weight bounded by tis), and the
actor trains."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from faults import Killed, kill_at, untimed
from serve_process import served_tiny_policy

from rlhf_dist.config import config_from_dict

TOKEN = "test-token-staleness-4d2a"
ENV = "RLHF_DIST_TEST_STALENESS_TOKEN"


@pytest.fixture(scope="module")
def server(task_env):
    """A `rlhf-dist serve` process of the tiny policy on a free port; its URL."""
    with served_tiny_policy(task_env.policy, ENV, TOKEN) as url:
        yield url


def _config(server, policy, out, task_env, data_cfg):
    return config_from_dict(
        {
            "run": {"output_dir": str(out), "seed": 0, "log_every": 1, "checkpoint_every": 5},
            "model": {"policy": str(policy)},
            "data": data_cfg(train=str(task_env.files.prompts)),
            "generation": {"max_new_tokens": 8, "temperature": 0.7, "backend": "server",
                           "server_urls": [server], "server_token_env": ENV},
            "reward": {"function": "rlhf_dist.demo.task:positive_word_reward"},
            "ppo": {"iterations": 10, "rollout_batch_size": 2, "samples_per_prompt": 4,
                    "rollout_micro_batch_size": 8, "ppo_epochs": 1, "minibatch_size": 8,
                    "micro_batch_size": 8, "optim": {"lr": 1e-3}, "kl_coef": 0.0,
                    "estimator": "grpo", "max_staleness": 4, "rollout_correction": "tis",
                    "decoupled": True},
            "distributed": {"timeout_s": 60},
        }
    )  # fmt: skip


def test_k4_killed_with_rollouts_in_flight_resumes_to_the_same_metrics(
    server,
    sft_run,
    task_env,
    runtime,
    tmp_path,
    monkeypatch,
    data_cfg,
    read_jsonl,
    saved_state_dict,
):
    from rlhf_dist.generation import factory
    from rlhf_dist.generation.prefetch import PrefetchingServer
    from rlhf_dist.trainers.ppo import recipe as ppo_module

    monkeypatch.setenv(ENV, TOKEN)
    made: list[PrefetchingServer] = []

    class Recorded(PrefetchingServer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(factory, "PrefetchingServer", Recorded)
    policy = sft_run.out / "final"

    def logged(out):
        rows = untimed(read_jsonl(out / "metrics.jsonl"))
        return [{k: v for k, v in r.items() if k != "rollout/policy_version"} for r in rows]

    ppo_module.train_ppo(
        _config(server, policy, tmp_path / "unbroken", task_env, data_cfg), runtime
    )
    assert made[-1].deferred  # one trainer process: the syncs ran on the worker
    before, after = saved_state_dict(policy), saved_state_dict(tmp_path / "unbroken" / "final")
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the actor trained
    cfg = _config(server, policy, tmp_path / "killed", task_env, data_cfg)
    with monkeypatch.context() as m:
        kill_at(m, ppo_module, "rollout", 8)
        with pytest.raises(Killed):
            ppo_module.train_ppo(cfg, runtime)
    # SIGKILL ends the killed trainer's worker with it: here its queued work is cancelled
    assert len(made[-1].queue) == 2  # iterations 9 and 10 were in flight
    made[-1].pool.shutdown(wait=True, cancel_futures=True)
    ppo_module.train_ppo(
        dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, resume="auto")), runtime
    )
    unbroken, resumed = logged(tmp_path / "unbroken"), logged(tmp_path / "killed")
    assert [r["rollout/staleness_max"] for r in unbroken] == [0, 1, 2, 3, 4] * 2
    assert [r["async/queue_depth"] for r in unbroken] == [4, 3, 2, 1, 0, 4, 3, 2, 1, 0]
    assert all(r["async/trained_len_mean"] == r["async/sampled_len_mean"] for r in unbroken)
    # the stale rollouts' sampler is behind the trainer's old log-probs
    assert all(r["rollout/sampler_logprob_absdiff"] > 1e-4 for r in unbroken[1:5])
    assert [r["step"] for r in resumed] == list(range(1, 11))
    assert resumed == unbroken


@pytest.mark.slow  # three trainer processes (~10 s of start-up each)
def test_k4_sigkilled_with_rollouts_in_flight_resumes_to_the_same_metrics(
    server, sft_run, task_env, tmp_path, data_cfg, read_jsonl
):
    """The test above with real processes: `rlhf-dist ppo` SIGKILLed (RLHF_DIST_FAULT) at
    iteration 8's rollout, its worker thread holding iterations 9 and 10's requests and the
    deferred syncs of iterations 7 and 8 (maybe half-sent: the server then refuses to serve
    the torn update until the resumed run's first sync), resumed by the same command with
    run.resume=auto from iteration 5's checkpoint."""
    import json
    import os
    import signal
    import subprocess
    import sys

    def run(out, *extra, fault=""):
        cfg = _config(server, sft_run.out / "final", out, task_env, data_cfg)
        path = tmp_path / f"{out.name}.json"
        path.write_text(json.dumps(dataclasses.asdict(cfg)))
        env = os.environ | {ENV: TOKEN, "OMP_NUM_THREADS": "1", "RLHF_DIST_FAULT": fault}
        cmd = [sys.executable, "-m", "rlhf_dist", "ppo", "--config", str(path), *extra]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)

    def logged(out):
        rows = untimed(read_jsonl(out / "metrics.jsonl"))
        return [{k: v for k, v in r.items() if k != "rollout/policy_version"} for r in rows]

    assert run(tmp_path / "unbroken").returncode == 0
    killed = run(tmp_path / "killed", fault="rollout:8")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    resumed = run(tmp_path / "killed", "run.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    unbroken, again = logged(tmp_path / "unbroken"), logged(tmp_path / "killed")
    assert [r["rollout/staleness_max"] for r in unbroken] == [0, 1, 2, 3, 4] * 2
    assert [r["step"] for r in again] == list(range(1, 11))
    assert again == unbroken
