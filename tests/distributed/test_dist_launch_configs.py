"""Every shipped accelerate config works from any working directory (issue 52, item 7).

The DeepSpeed configs name their JSON file relative to the checkout
(`ds_configs/zero3.json`); `accelerate launch` passes the name on as it is, and Accelerate
reads it from the working directory. The launch here starts in an empty directory and goes
through to a built engine and one optimizer step (scripts/engine_probe.py); cpu_zero3 and
cpu_fsdp2 start from another directory in test_dist_engines.py, cpu_zero2 in
test_dist_split_invariance.py's ZeRO-2 gradient probe. The configs without a DeepSpeed file
(cpu_single, cpu_ddp) name no path and are not launched; the GPU configs and
cpu_zero3_2machines name the same files, resolved here without a launch.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import yaml
from conftest import CONFIGS, REPO, free_port, launch_args, run_all

from rlhf_dist.distributed import fsdp2
from rlhf_dist.distributed.deepspeed_config import DS_FILE_VARIABLE, resolve_deepspeed_file
from rlhf_dist.errors import ConfigError

PROBE = REPO / "tests" / "distributed" / "scripts" / "engine_probe.py"


def test_shipped_zero0_config_launches_from_another_directory(tmp_path):
    out = tmp_path / "zero0.json"
    launch = launch_args("cpu_zero0.yaml", free_port(), str(PROBE), str(out))
    ((code, stdout, stderr),) = run_all([launch], 180, [{}], cwd=tmp_path)
    assert code == 0, f"zero0 exited {code}\n{(stdout + stderr)[-6000:]}"
    result = json.loads(out.read_text())
    assert result["engine"] == "zero0" and result["world_size"] == 2 and result["changed"]


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


def shipped_fsdp_configs() -> list[dict]:
    configs = [yaml.safe_load(p.read_text()) for p in sorted(CONFIGS.glob("*fsdp2*.yaml"))]
    assert len(configs) == 3  # cpu_fsdp2, fsdp2, fsdp2_multinode
    return configs


@pytest.mark.parametrize(
    ("variable", "value", "key"),
    [
        ("FSDP_VERSION", "1", "fsdp_version"),
        ("FSDP_CPU_RAM_EFFICIENT_LOADING", "true", "fsdp_cpu_ram_efficient_loading"),
        ("FSDP_ACTIVATION_CHECKPOINTING", "true", "fsdp_activation_checkpointing"),
        ("FSDP_OFFLOAD_PARAMS", "true", "fsdp_offload_params"),  # on CPU ranks
    ],
)
def test_fsdp_settings_this_engine_does_not_do_are_one_line(monkeypatch, variable, value, key):
    for config in shipped_fsdp_configs():  # the shipped configs pass as written
        fsdp = config["fsdp_config"]
        assert fsdp["fsdp_version"] == 2 and fsdp["fsdp_cpu_ram_efficient_loading"] is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # CPU ranks
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")
    fsdp2.check_fsdp_config()
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError, match=key) as e:
        fsdp2.check_fsdp_config()
    assert "\n" not in str(e.value)


def test_qlora_weights_are_refused_under_fsdp2():
    class Params4bit(torch.nn.Parameter):  # bitsandbytes' 4-bit weight class, by name
        pass

    model = torch.nn.Linear(4, 4)
    model.weight = Params4bit(torch.zeros(4, 4), requires_grad=False)
    optimizer = torch.optim.AdamW([model.bias])
    with pytest.raises(ConfigError, match="lora.load_in_4bit"):
        fsdp2.shard_model(model, optimizer, torch.device("cpu"), "float32")
