"""launch/slurm_serve_and_train.sh under stand-ins for srun and scontrol (scripts/slurm/):
three "nodes" of one machine (localhost, 127.0.0.1, 127.0.0.2), the first serving, the
other two training as two machines under ZeRO-3 over gloo (GPUS_PER_NODE=cpu), one step
off-policy. What Slurm itself does (allocation, placement, cgroups) is not tested here;
the script's own work is: the node split, the servers on their node's address, the
health wait, the trainer's multi-node launch against them with the sync address of rank
0's node, and the servers gone when the job ends."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request

import pytest
import yaml
from conftest import REPO, free_port

STUBS = REPO / "tests" / "distributed" / "scripts" / "slurm"


def test_servers_on_one_node_and_a_two_node_trainer_one_step_off_policy(assets, tmp_path):
    out, port = tmp_path / "run", free_port()
    config = tmp_path / "run.yaml"
    tree = {
        "model": {"policy": assets["policy"], "reward": assets["reward"]},
        "data": {"train": str(assets["files"].prompts)},
        "run": {"output_dir": str(out), "log_every": 1},
        "generation": {"max_new_tokens": 12},
        "ppo": {
            "iterations": 3,
            "rollout_batch_size": 8,
            "samples_per_prompt": 2,
            "rollout_micro_batch_size": 8,
            "minibatch_size": 8,
            "micro_batch_size": 2,
            "ppo_epochs": 1,
            "optim": {"lr": 1e-3},
        },  # fmt: skip
        "perf": {"num_threads": 1},
        "distributed": {"timeout_s": 60},
    }
    config.write_text(yaml.safe_dump(tree), encoding="utf-8")
    env = dict(os.environ, PATH=f"{STUBS}{os.pathsep}{os.environ['PATH']}",
               SLURM_JOB_NODELIST="localhost,127.0.0.1,127.0.0.2", SLURM_JOB_ID="4242",
               SLURM_SUBMIT_DIR=str(REPO), GPUS_PER_NODE="cpu", BASE_PORT=str(port),
               LOGS=str(tmp_path / "logs"), STALENESS="1", OMP_NUM_THREADS="1")  # fmt: skip
    env.pop("RLHF_DIST_SERVER_TOKEN", None)  # the script makes one
    proc = subprocess.run(
        ["bash", str(REPO / "launch" / "slurm_serve_and_train.sh"), str(config)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert f"rollout servers up: http://localhost:{port}" in proc.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rollout/sequences"] == 16 for r in rows)  # both ranks' prompts, served
    # iteration 1 on-policy; iteration k's rollout sampled by the weights synced in k-1
    assert [r["rollout/staleness_max"] for r in rows] == [0, 1, 1]
    assert [r["rollout/policy_version"] for r in rows] == [1, 1, 2]
    try:  # the servers ended with the job
        urllib.request.urlopen(f"http://localhost:{port}/health", timeout=5)
        raise AssertionError("a server outlived the job")
    except OSError:
        pass


def _slurm_env(tmp_path, **extra):
    """Stand-ins on PATH: the stub scontrol, and an srun that only reports the accelerate
    config the launch would use (no process is launched)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    srun = bin_dir / "srun"
    srun.write_text('#!/usr/bin/env bash\necho "launch with $ACCELERATE_CONFIG ${ENGINE_ARGS:-}"\n')
    srun.chmod(0o755)
    path = f"{bin_dir}{os.pathsep}{STUBS}{os.pathsep}{os.environ['PATH']}"
    env = dict(os.environ, PATH=path, SLURM_JOB_NODELIST="localhost,127.0.0.1",
               SLURM_JOB_ID="4242", SLURM_NNODES="2", SLURM_SUBMIT_DIR=str(REPO))  # fmt: skip
    for key in ("ENGINE", "ACCELERATE_CONFIG"):
        env.pop(key, None)
    return env | extra


@pytest.mark.parametrize(
    ("engine", "config"),
    [(None, "zero3_multinode.yaml"), ("zero3", "zero3_multinode.yaml"),
     ("fsdp2", "fsdp2_multinode.yaml")],
)  # fmt: skip
def test_slurm_ppo_takes_either_engine(tmp_path, engine, config):
    env = _slurm_env(tmp_path, **({"ENGINE": engine} if engine else {}))
    proc = subprocess.run(["bash", str(REPO / "launch" / "slurm_ppo.sh")], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert f"launch with accelerate_configs/{config}" in proc.stdout
    assert (REPO / "accelerate_configs" / config).is_file()
    # FSDP2 refuses the run config's frozen_models=partition: the recipe replicates them
    replicated = "distributed.frozen_models=replicate" in proc.stdout
    assert replicated == (engine == "fsdp2")


@pytest.mark.parametrize(
    ("engine", "gpus", "config"),
    [("zero3", "8", "zero3_multinode.yaml"), ("zero3", "cpu", "cpu_zero3_2machines.yaml"),
     ("fsdp2", "8", "fsdp2_multinode.yaml"), ("fsdp2", "cpu", "cpu_fsdp2.yaml")],
)  # fmt: skip
def test_engine_config_of_each_engine_and_device(engine, gpus, config):
    proc = subprocess.run(["bash", "-c", '. launch/slurm_engine.sh && engine_config "$0" "$1"',
                           engine, gpus], cwd=REPO, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.stdout.strip() == f"accelerate_configs/{config}", proc.stderr
    assert (REPO / "accelerate_configs" / config).is_file()


@pytest.mark.parametrize("script", ["slurm_ppo.sh", "slurm_serve_and_train.sh"])
def test_an_unknown_engine_is_refused_in_one_line(tmp_path, script):
    env = _slurm_env(tmp_path, ENGINE="zero2")
    proc = subprocess.run(["bash", str(REPO / "launch" / script), "run.yaml"], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip() == "ENGINE=zero2: not an engine (zero3 or fsdp2)"
    assert "launch with" not in proc.stdout  # refused before any srun
