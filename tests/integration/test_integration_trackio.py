"""run.trackers=[trackio]: a tiny SFT run from the command line sends every scalar of
metrics.jsonl, the held-out eval/ figures and the histograms to trackio's local store
($TRACKIO_DIR), read back with trackio's own reader, and never touches the network.

A real subprocess (`python -m rlhf_dist sft`), as a user runs it: trackio reads
$TRACKIO_DIR once, when it is first imported, so the store must be chosen before the
process starts. Every outgoing internet connection of that process is refused and
written down by a sitecustomize module put first on its path. launch/setup.sh installs
trackio: without it this test fails rather than skips, so a missing install step shows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

NO_NETWORK = """
import os, socket

def _refuse(address):
    with open(os.environ["NETWORK_ATTEMPTS"], "a") as f:
        f.write(repr(address) + "\\n")
    raise OSError(f"network refused in this test: {address!r}")

_connect = socket.socket.connect

def connect(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6):
        _refuse(address)
    return _connect(self, address)

def create_connection(address, *args, **kwargs):
    _refuse(address)

socket.socket.connect = connect
socket.create_connection = create_connection
"""


def _run(args: list[str], env: dict) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{args[:4]} failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
    return proc


def _split(source: Path, root: Path, n_train: int, n_eval: int) -> tuple[str, str]:
    lines = source.read_text(encoding="utf-8").splitlines(keepends=True)
    train, held_out = root / "train.jsonl", root / "eval.jsonl"
    train.write_text("".join(lines[:n_train]), encoding="utf-8")
    held_out.write_text("".join(lines[n_train : n_train + n_eval]), encoding="utf-8")
    return str(train), str(held_out)


@pytest.mark.slow
def test_sft_logs_scalars_and_eval_to_the_local_trackio_store(task_env, tmp_path, read_jsonl):
    guard = tmp_path / "guard"
    guard.mkdir()
    (guard / "sitecustomize.py").write_text(NO_NETWORK, encoding="utf-8")
    attempts, store = tmp_path / "network_attempts.txt", tmp_path / "trackio"
    attempts.touch()
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env = base | {
        "PYTHONPATH": f"{guard}{os.pathsep}{REPO}",
        "OMP_NUM_THREADS": "1",
        "TRACKIO_DIR": str(store),
        "NETWORK_ATTEMPTS": str(attempts),
        "HF_HUB_OFFLINE": "1",
    }
    env.pop("TRACKIO_SPACE_ID", None), env.pop("TRACKIO_SERVER_URL", None)
    # The guard is in place: a connection from a process started this way is refused and noted.
    probe = [sys.executable, "-c", "import socket; socket.create_connection(('192.0.2.1', 9))"]
    assert subprocess.run(probe, env=env, capture_output=True, timeout=60).returncode != 0
    assert "192.0.2.1" in attempts.read_text()
    attempts.write_text("")
    train, held_out = _split(task_env.files.sft, tmp_path, 64, 16)
    out = tmp_path / "sft-run"
    _run(
        [
            sys.executable, "-m", "rlhf_dist", "sft", "run.progress=false",
            f"model.policy={task_env.policy}", f"data.train={train}", f"data.eval={held_out}",
            "data.max_prompt_length=16", "data.max_length=48", f"run.output_dir={out}",
            "sft.epochs=1", "sft.batch_size=16", "sft.micro_batch_size=16",
            "run.histogram_every=2", "run.eval_every=2", "run.trackers=[trackio]",
            "run.project=rlhf-trackio-test",
        ],
        env,
    )  # fmt: skip
    assert attempts.read_text() == "", "the run tried the network"
    rows = read_jsonl(out / "metrics.jsonl")

    def stored(metric: str) -> dict:
        """step -> value of `metric` in the trackio run, through trackio's own CLI."""
        proc = _run(
            [
                sys.executable, "-m", "trackio.cli", "get", "metric", "--project",
                "rlhf-trackio-test", "--run", "sft-run-sft", "--metric", metric, "--json",
            ],
            env,
        )  # fmt: skip
        return {v["step"]: v["value"] for v in json.loads(proc.stdout)["values"]}

    # Every number of every metrics row, at its step, as metrics.jsonl holds it.
    for name in ("sft/loss", "sft/grad_norm", "sft/lr", "sft/pad_fraction", "eval/loss"):
        logged = {r["step"]: r[name] for r in rows if name in r}
        assert logged and stored(name) == pytest.approx(logged, rel=1e-6), name
    assert sorted(stored("eval/loss")) == [2, 4]
    assert stored("dist/sequence_nll/p50")  # the histograms' quantiles, as in the rows
    # The histograms themselves: as distributions.jsonl holds them, as trackio histograms.
    hists = read_jsonl(out / "distributions.jsonl")
    counts = {h["step"]: h["counts"] for h in hists if h["name"] == "sequence_nll"}
    kept = stored("dist/sequence_nll")
    assert {step: v["values"] for step, v in kept.items()} == counts == {2: counts[2], 4: counts[4]}
    assert {v["_type"] for v in kept.values()} == {"trackio.histogram"}
    assert attempts.read_text() == "", "reading the store tried the network"
