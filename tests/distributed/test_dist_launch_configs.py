"""Every shipped accelerate config works from any working directory (issue 52, item 7).

The DeepSpeed configs name their JSON file relative to the checkout
(`ds_configs/zero3.json`); `accelerate launch` passes the name on as it is, and Accelerate
reads it from the working directory. The launches here start in an empty directory and go
through to a built engine and one optimizer step (scripts/engine_probe.py). The configs
without a DeepSpeed file (cpu_single, cpu_ddp) name no path and are not launched; the
GPU configs and cpu_zero3_2machines name the same files, checked without a launch.
"""

from __future__ import annotations

import json
import os

import pytest
import yaml
from conftest import CONFIGS, REPO, free_port, launch_args, run_launch

from rlhf_dist.distributed.deepspeed_config import DS_FILE_VARIABLE, resolve_deepspeed_file
from rlhf_dist.errors import ConfigError

PROBE = REPO / "tests" / "distributed" / "scripts" / "engine_probe.py"


@pytest.mark.parametrize(
    ("config", "engine"),
    [
        ("cpu_zero0.yaml", "zero0"),
        ("cpu_zero2.yaml", "zero2"),
        ("cpu_zero3.yaml", "zero3"),
        ("cpu_fsdp2.yaml", "fsdp2"),
    ],
)
def test_shipped_cpu_config_launches_from_another_directory(tmp_path, config, engine):
    out = tmp_path / "probe.json"
    run_launch(launch_args(config, free_port(), str(PROBE), str(out)), timeout=180, cwd=tmp_path)
    result = json.loads(out.read_text())
    assert result["engine"] == engine
    assert result["world_size"] == 2
    assert result["changed"]


def shipped_deepspeed_files() -> list[tuple[str, str]]:
    """(config name, its deepspeed_config_file) for every shipped accelerate config that has one."""
    named = []
    for path in sorted(CONFIGS.glob("*.yaml")):
        ds = (yaml.safe_load(path.read_text()) or {}).get("deepspeed_config") or {}
        if "deepspeed_config_file" in ds:
            named.append((path.name, ds["deepspeed_config_file"]))
    return named


def test_every_shipped_deepspeed_file_resolves_from_another_directory(tmp_path, monkeypatch):
    named = shipped_deepspeed_files()
    assert len(named) >= 8  # the cpu_* and GPU DeepSpeed configs
    monkeypatch.chdir(tmp_path)
    for config, name in named:
        environ = {DS_FILE_VARIABLE: name}
        resolve_deepspeed_file(environ)
        resolved = environ[DS_FILE_VARIABLE]
        assert os.path.isabs(resolved) and os.path.isfile(resolved), config


def test_a_missing_deepspeed_file_is_one_line_naming_the_key(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="deepspeed_config_file 'ds_configs/nope.json'") as e:
        resolve_deepspeed_file({DS_FILE_VARIABLE: "ds_configs/nope.json"})
    assert "\n" not in str(e.value)
    (tmp_path / "mine.json").write_text("{}")  # the user's own file, from where they launch
    environ = {DS_FILE_VARIABLE: "mine.json"}
    resolve_deepspeed_file(environ)
    assert environ[DS_FILE_VARIABLE] == str(tmp_path / "mine.json")
