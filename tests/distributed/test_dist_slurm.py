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
