"""Fixtures for 2-rank tests: tiny task files and models, and an `accelerate launch` runner.

Every test here starts real processes with `accelerate launch` on CPU (gloo), exactly as
a user would, and fails with the tail of their output if they exit non-zero or hang.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "accelerate_configs"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_args(config: str, port: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(CONFIGS / config),
        "--main_process_port", str(port),
        *extra,
    ]  # fmt: skip


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_launch(
    args: list[str], timeout: float = 120.0, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run one launcher command (with `env` added to the environment); fail the test with
    its output tail on error or timeout."""
    try:
        proc = subprocess.run(
            args,
            cwd=REPO,
            env=_env() | (env or {}),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"")[-4000:] if isinstance(e.stdout, bytes) else (e.stdout or "")[-4000:]
        pytest.fail(f"launch timed out after {timeout}s (a hang?)\n{out}")
    if proc.returncode != 0:
        pytest.fail(f"launch exited {proc.returncode}\n{(proc.stdout + proc.stderr)[-6000:]}")
    return proc


def shm_buffers(port: int) -> list[Path]:
    """DeepSpeed CPU allreduce buffers in /dev/shm of a launch on `port` (all ranks):
    "deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>"."""
    return sorted(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"))


def run_two_machines(config: str, command: list[str], timeout: float = 120.0) -> None:
    """Two 'machines' (one process each) on 127.0.0.1 with machine ranks 0 and 1."""
    port = free_port()
    procs = []
    for machine_rank in (0, 1):
        args = launch_args(config, port, "--machine_rank", str(machine_rank), *command)
        procs.append(
            subprocess.Popen(
                args,
                cwd=REPO,
                env=_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail("two-machine launch timed out (a hang?)")
    for p, out in zip(procs, outputs):
        if p.returncode != 0:
            pytest.fail(f"machine exited {p.returncode}\n{out[-6000:]}")


def ppo_command(assets, out: Path, *extra: str) -> list[str]:
    """`python -m rlhf_dist ppo` on the tiny assets: 2 iterations of 16 prompts, minibatches
    of 8 in micro-batches of 2, 12 new tokens; `extra` overrides come last and win."""
    return [
        "-m", "rlhf_dist", "ppo",
        f"model.policy={assets['policy']}",
        f"model.reward={assets['reward']}",
        f"data.train={assets['files'].prompts}",
        f"run.output_dir={out}",
        "run.log_every=1",
        "ppo.iterations=2",
        "ppo.rollout_batch_size=16",
        "ppo.rollout_micro_batch_size=8",
        "ppo.minibatch_size=8",
        "ppo.micro_batch_size=2",
        "ppo.ppo_epochs=1",
        "ppo.optim.lr=1e-3",
        "ppo.critic_optim.lr=1e-3",
        "generation.max_new_tokens=12",
        *extra,
    ]  # fmt: skip


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    """Task files, tokenizer and random-init tiny policy + reward model (with its head)."""
    from rlhf_dist.demo import task
    from rlhf_dist.models import quiet_transformers

    quiet_transformers()
    root = tmp_path_factory.mktemp("dist_assets")
    files = task.write_task(
        root / "task",
        seed=0,
        n_sft=256,
        n_pref=256,
        n_pref_eval=64,
        n_prompts=128,
        n_eval_prompts=32,
    )
    tokenizer = task.build_tokenizer(files.tokenizer_dir)
    models = task.build_tiny_models(root / "models", tokenizer, size="tiny", seed=0)
    return {
        "files": files,
        "policy": str(models["policy"]),
        "reward": str(models["reward"]),
        "root": root,
    }


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes minutes on a 2-core CPU")
