"""Fixtures for 2-rank tests: tiny task files and models, and an `accelerate launch` runner.

Every test here starts real processes with `accelerate launch` on CPU (gloo), exactly as
a user would, and fails with the tail of their output if they exit non-zero or hang.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "accelerate_configs"


# The two sharded engines a 2-rank test may run under (docs/distributed.md "Choosing the
# engine"), each by its CPU accelerate config; `engines` parametrizes a test over them.
ENGINES = {"zero3": "cpu_zero3.yaml", "fsdp2": "cpu_fsdp2.yaml"}
# Set to 1, the variants that launch/test.sh leaves out run too (docs/distributed.md
# "Which 2-rank tests run under both engines").
ALL_ENGINES = "RLHF_DIST_TEST_ALL_ENGINES"


def engines(*in_ci: str) -> list:
    """pytest parameters `engine` = zero3, fsdp2 (ids the same). An engine not named in
    `in_ci` runs only with RLHF_DIST_TEST_ALL_ENGINES=1; without it that variant is a
    reported skip. ZeRO-3 always runs."""
    opt_in = os.environ.get(ALL_ENGINES) == "1"
    skip = pytest.mark.skip(reason=f"an opt-in engine variant: {ALL_ENGINES}=1 runs it")
    return [
        pytest.param(e, id=e, marks=() if e == "zero3" or e in in_ci or opt_in else skip)
        for e in ENGINES
    ]


def two_machine_args(engine: str, port: int, machine_rank: int, *extra: str) -> list[str]:
    """launch_args of one of two 'machines' on 127.0.0.1 (one rank each) under `engine`:
    ZeRO-3's multi-node config (its standard launcher), or cpu_fsdp2.yaml with the
    placement on the command line, as launch/slurm_engine.sh gives it."""
    rank = ("--machine_rank", str(machine_rank))
    if engine == "zero3":
        return launch_args("cpu_zero3_2machines.yaml", port, *rank, *extra)
    placement = ("--num_machines", "2", "--num_processes", "2", "--main_process_ip", "127.0.0.1")
    return launch_args(ENGINES[engine], port, *placement, *rank, *extra)


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
    args: list[str], timeout: float = 120.0, env: dict | None = None, cwd: Path = REPO
) -> subprocess.CompletedProcess:
    """Run one launcher command (with `env` added to the environment, in `cwd`); fail the
    test with its output tail on error, or on a hang with every rank's stack (run_all)."""
    ((returncode, out, err),) = run_all([args], timeout, [env or {}], cwd)
    if returncode != 0:
        pytest.fail(f"launch exited {returncode}\n{(out + err)[-6000:]}")
    return subprocess.CompletedProcess(args, returncode, out, err)


def shm_buffers(port: int) -> list[Path]:
    """DeepSpeed CPU allreduce buffers in /dev/shm of a launch on `port` (all ranks):
    "deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>"."""
    return sorted(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"))


def run_two_machines(engine: str, command: list[str], timeout: float = 120.0) -> None:
    """Two 'machines' (one process each) on 127.0.0.1 with machine ranks 0 and 1, under
    `engine` (zero3 or fsdp2)."""
    port = free_port()
    machines = [two_machine_args(engine, port, rank, *command) for rank in (0, 1)]
    for rank, (returncode, out, err) in enumerate(run_all(machines, timeout, [{}, {}])):
        if returncode != 0:
            pytest.fail(f"machine {rank} exited {returncode}\n{(out + err)[-6000:]}")


def run_all(
    commands: list[list[str]], timeout: float, envs: list[dict], cwd: Path = REPO
) -> list[tuple[int, str, str]]:
    """Run the commands at once (in `cwd`), each with its `envs` entry added to the
    environment; (return code, stdout, stderr) of each.

    Output goes to files, never to pipes: a pipe read only after another process finishes
    fills at 64 KiB and blocks its writer inside a step while its peer waits in a
    collective. On a hang every process gets SIGABRT with faulthandler on, and the test
    fails with each one's output tail: where every rank stood."""
    with tempfile.TemporaryDirectory(prefix="launch_") as tmp:
        logs = [(Path(tmp, f"{i}.out"), Path(tmp, f"{i}.err")) for i in range(len(commands))]
        procs = []
        for args, env, (out, err) in zip(commands, envs, logs, strict=True):
            with out.open("w") as stdout, err.open("w") as stderr:
                procs.append(
                    subprocess.Popen(
                        args,
                        cwd=cwd,
                        env=_env() | {"PYTHONFAULTHANDLER": "1"} | env,
                        stdout=stdout,
                        stderr=stderr,
                    )
                )
        hung = _wait_all(procs, timeout)
        outputs = [
            (p.returncode, out.read_text(), err.read_text()) for p, (out, err) in zip(procs, logs)
        ]
    if hung:
        tails = [f"process {i}:\n{(out + err)[-8000:]}" for i, (_, out, err) in enumerate(outputs)]
        pytest.fail(f"launch timed out after {timeout}s (a hang?)\n" + "\n".join(tails))
    return outputs


def metrics_rows(out: Path) -> list[dict]:
    """The rows of a run directory's metrics.jsonl."""
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]


def one_rank_and_zero3(stage_args, work: Path, env: dict, timeout: float = 240.0) -> dict:
    """Run `stage_args(out)` (a `-m rlhf_dist ...` argument list) as one process and under a
    2-rank cpu_zero3 launch at once; the metrics rows of each, {"one": [...], "two": [...]}."""
    one, two = work / "one", work / "two"
    commands = [
        [sys.executable, *stage_args(one)],
        launch_args("cpu_zero3.yaml", free_port(), *stage_args(two)),
    ]
    for code, out, err in run_all(commands, timeout, [env, env]):
        if code != 0:
            pytest.fail(f"exited {code}\n{(out + err)[-6000:]}")
    return {"one": metrics_rows(one), "two": metrics_rows(two)}


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> bool:
    """Wait for every process; on timeout abort each launcher's workers, then any launcher
    still running (faulthandler prints each one's stacks; the workers run in sessions of
    their own, so a process group would miss them), kill what is left, and return True."""
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        return False
    except subprocess.TimeoutExpired:
        trees = [_tree(p.pid) for p in procs]
        for tree in trees:  # the workers first: their launchers then report them
            _signal_all(tree[1:], signal.SIGABRT)
        time.sleep(3)  # time to write the stacks
        for p, tree in zip(procs, trees):  # a launcher still there is stuck itself
            if p.poll() is None:
                _signal_all(tree[:1], signal.SIGABRT)
        time.sleep(1)
        for tree in trees:
            _signal_all(tree, signal.SIGKILL)
        for p in procs:
            p.wait()
        return True


def _tree(pid: int) -> list[psutil.Process]:
    """The process `pid` and all its descendants."""
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    return []


def _signal_all(processes: list[psutil.Process], sig: int) -> None:
    for proc in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(sig)


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
