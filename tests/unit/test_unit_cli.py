"""Unit tests of the command line (rlhf_dist/cli.py), run as `python -m rlhf_dist`.

The promise under test (cli.py docstring): `--help` works for every command, and a user
mistake ends as ONE line on stderr starting with `rlhf-dist`, exit status 2, no traceback.
Each case fails before any model is loaded, so the subprocesses stay fast; they are real
subprocesses because what a user sees (stderr, exit status) is the contract.
"""

import dataclasses
import fcntl
import os
import subprocess
import sys

import pytest

from rlhf_dist.config import Config

COMMANDS = ["sft", "rm", "ppo", "dpo", "kto", "eval", "demo", "config"]


def run_cli(*args: str, cwd, env: dict | None = None) -> subprocess.CompletedProcess:
    # The launcher's rank variables of an outer run must not leak into the ones under test.
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    return subprocess.run(
        [sys.executable, "-m", "rlhf_dist", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env=base | (env or {}),
    )


def assert_one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{proc.stderr}"
    assert lines[0].strip() and lines[0].startswith("rlhf-dist"), lines[0]
    return lines[0]


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_exits_zero(command, tmp_path):
    args = ["--help"] if command is None else [command, "--help"]
    proc = run_cli(*args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: rlhf-dist")
    if command is None:
        for name in COMMANDS:  # every subcommand is listed at the top level
            assert name in proc.stdout
    # --help must not start a run (demo writes runs/demo by default).
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["sft", "ppo.kl_coeff=0.1"], "ppo.kl_coeff"),  # unknown key
        (["ppo", "ppo.iterations=ten"], "ppo.iterations"),  # wrong type
        (
            ["ppo", "model.policy=/p", "data.train=/d.jsonl", "reward.function=m:f"]
            + ["ppo.rollout_batch_size=64", "ppo.minibatch_size=24"],
            "ppo.minibatch_size",
        ),  # divisibility
        (["rm", "--config", "does_not_exist.yaml"], "does_not_exist.yaml"),
    ],
)
def test_config_mistakes_are_one_line(args, needle, tmp_path):
    line = assert_one_line_error(run_cli(*args, cwd=tmp_path))
    assert line.startswith(f"rlhf-dist {args[0]}: error: "), line
    assert needle in line


@pytest.fixture(scope="module")
def missing_model_run(tmp_path_factory) -> subprocess.CompletedProcess:
    """`sft` with an absent policy path: refused by the inputs check before torch loads
    (config/paths.py), with the loader's words."""
    root = tmp_path_factory.mktemp("cli_missing_model")
    data = root / "train.jsonl"
    data.write_text('{"prompt": "review of the food :", "response": "great"}\n')
    return run_cli(
        "sft",
        "model.policy=/nonexistent/policy",
        f"data.train={data}",
        f"run.output_dir={root / 'run'}",
        cwd=root,
    )


def test_missing_model_path_is_one_line(missing_model_run):
    line = assert_one_line_error(missing_model_run)
    assert line.startswith("rlhf-dist sft: error: ")
    assert "/nonexistent/policy" in line


def test_missing_model_path_names_the_key_the_user_set(missing_model_run):
    assert "model.policy" in assert_one_line_error(missing_model_run)


def test_missing_inputs_are_refused_before_torch_is_imported(tmp_path):
    # the CLI as a user runs it, in one process that then reports what it imported
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    code = (
        "import sys; from rlhf_dist.cli import main\n"
        f"rc = main(['sft', 'model.policy=/nonexistent/policy', 'data.train={empty}'])\n"
        f"rc2 = main(['sft', 'model.policy={tmp_path}', 'data.train={empty}'])\n"
        "print(rc, rc2, 'torch' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["2", "2", "False"], proc.stderr
    lines = proc.stderr.splitlines()
    assert "model.policy: model path '/nonexistent/policy' does not exist" in lines[0]
    assert f"data.train: data file '{empty}' is empty" in lines[1]


@pytest.mark.parametrize("stage", ["sft", "rm", "ppo", "dpo", "kto", "eval"])
def test_stage_help_points_to_the_config_listing(stage, tmp_path):
    out = " ".join(run_cli(stage, "--help", cwd=tmp_path).stdout.split())
    assert "rlhf-dist config [SECTION]" in out
    assert "distributed" in out  # --config lists every section, not a stale subset


def test_config_command_lists_keys_with_type_default_and_meaning(tmp_path):
    proc = run_cli("config", "ppo", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "  ppo.optim.lr  float = 3e-06  (> 0)" in lines
    assert '  ppo.kl_controller  str = "fixed"  (one of: fixed, adaptive)' in lines
    assert "  ppo.ptx_coef  float = 0.0  (>= 0)" in lines
    assert "run.seed" not in proc.stdout
    everything = run_cli("config", cwd=tmp_path).stdout
    assert "run.seed" in everything and "distributed.timeout_s" in everything
    # Every key of every section (the dataclasses walked), with its help text, in what
    # `rlhf-dist config` prints: issue 25's reward, judge and QLoRA keys among them.
    keys = dict(config_keys(Config))
    assert {"reward.functions", "reward.weights", "reward.url", "reward.judge_model",
            "reward.judge_url", "reward.api_key_env", "lora.load_in_4bit", "ppo.ptx_coef",
            "data.ptx"} <= keys.keys()  # fmt: skip
    heads = [line.split(":")[0] if not line.startswith(" ") else line.split()[0]
             for line in everything.splitlines() if line.strip()]  # fmt: skip
    flat = " ".join(everything.split())
    for name, f in keys.items():
        assert name in heads, f"rlhf-dist config does not list {name}"  # a key or a section
        assert f.metadata["help"].strip() and " ".join(f.metadata["help"].split()) in flat, name


def config_keys(cls, prefix=""):
    """(dotted name, field) of every key and section reachable from the dataclass `cls`."""
    for f in dataclasses.fields(cls):
        yield f"{prefix}{f.name}", f
        if dataclasses.is_dataclass(f.default):
            yield from config_keys(type(f.default), f"{prefix}{f.name}.")


def test_config_command_unknown_section_is_one_line(tmp_path):
    line = assert_one_line_error(run_cli("config", "ppx", cwd=tmp_path))
    assert line.startswith("rlhf-dist config: error: ppx: ")


# What `accelerate launch` sets on the second process of one machine, and on the first.
SECOND_RANK = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}
FIRST_RANK = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}


@pytest.mark.parametrize("args", [["ppo", "ppo.kl_coeff=0.1"], ["rm", "--config", "nope.yaml"]])
def test_config_error_before_ranks_connect_is_printed_by_the_first_rank_only(args, tmp_path):
    first = run_cli(*args, cwd=tmp_path, env=FIRST_RANK)
    assert_one_line_error(first)
    second = run_cli(*args, cwd=tmp_path, env=SECOND_RANK)
    assert second.returncode == 2, second.stderr
    assert second.stderr == "" and second.stdout == ""
    # Only RANK set (a launcher without LOCAL_RANK): rank 1 stays quiet too.
    only_rank = run_cli(*args, cwd=tmp_path, env={"RANK": "1", "WORLD_SIZE": "2"})
    assert only_rank.returncode == 2 and only_rank.stderr == ""


def test_a_reader_that_stops_early_is_not_an_error(tmp_path):
    # `rlhf-dist config | head -1`: the reader closes the pipe after one line, while the
    # writer still has most of its text to write (a 4 KiB pipe: Linux's smallest).
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, 1031, 4096)  # F_SETPIPE_SZ
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlhf_dist", "config"],
        cwd=tmp_path,
        stdout=write_end,
        stderr=subprocess.PIPE,
    )
    os.close(write_end)
    with os.fdopen(read_end, "rb") as out:
        first = out.readline()
    assert proc.stderr is not None
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0, err
    assert first.startswith(b"run:") and err == ""


def test_a_machines_other_ranks_stay_silent_and_leave_the_first_time_to_print(tmp_path):
    """Before the process group exists every rank meets the same mistake: one line per
    machine, from its first rank. The others print nothing and wait the grace period
    (cli.DUPLICATE_ERROR_GRACE_S) before exiting, since the launcher stops every rank once
    one exits, and the first rank could be stopped before it printed."""
    import time

    from rlhf_dist import cli

    args = ["sft", "ppo.kl_coeff=0.1"]
    start = time.monotonic()
    other = run_cli(*args, cwd=tmp_path, env={"LOCAL_RANK": "1", "RANK": "1"})
    assert other.returncode == 2 and other.stderr == "", other.stderr
    assert time.monotonic() - start >= cli.DUPLICATE_ERROR_GRACE_S
    first = run_cli(*args, cwd=tmp_path, env={"LOCAL_RANK": "0", "RANK": "2"})
    assert "ppo.kl_coeff" in assert_one_line_error(first)
