"""The front door: every shipped config and the defaults validate on 1, 2, 8 and 16 ranks;
presets lie under the user's keys; `rlhf-dist grpo` is `rlhf-dist ppo` with the grpo
preset; `rlhf-dist config --yaml STAGE` writes a file that reads back to the same Config.
All torch-free: validation happens before any model loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_dist import cli
from rlhf_dist.config import Config, load_config, starter_yaml, to_dict, validate
from rlhf_dist.config.presets import PRESETS
from rlhf_dist.config.starter import STAGE_SECTIONS

CONFIGS = Path(__file__).resolve().parents[2] / "launch" / "configs"
WORLD_SIZES = (1, 2, 8, 16)
# what a run needs besides the defaults: a model, data and (PPO) a reward
REQUIRED = ["model.policy=/m", "data.train=/d.jsonl", "reward.function=m:f"]


def shipped() -> list[tuple[str, str, str | None]]:
    """(file, stage, preset) of every config in launch/configs, by its name's prefix."""
    out = []
    for path in sorted(CONFIGS.glob("*.yaml")):
        prefix = path.name.split("_")[0]
        stage, preset = ("ppo", "grpo") if prefix == "grpo" else (prefix, None)
        out.append((str(path), stage, preset))
    return out


def test_every_config_in_launch_configs_is_covered():
    assert {stage for _, stage, _ in shipped()} >= {"sft", "rm", "ppo", "dpo"}
    assert any(p == "grpo" for _, _, p in shipped())


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("path, stage, preset", shipped(), ids=lambda x: str(x).split("/")[-1])
def test_shipped_configs_validate_on_any_world_size(path, stage, preset, world_size):
    validate(load_config(path, [], preset), stage, world_size)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("stage", ["sft", "rm", "dpo", "kto", "ppo", *PRESETS])
def test_the_defaults_validate_on_any_world_size(stage, world_size):
    preset = stage if stage in PRESETS else None
    validate(load_config(None, REQUIRED, preset), "ppo" if preset else stage, world_size)


@pytest.mark.parametrize("name", [*STAGE_SECTIONS, *PRESETS])
def test_the_starter_file_reads_back_to_the_same_config(name, tmp_path):
    path = tmp_path / f"{name}.yaml"
    path.write_text(starter_yaml(name), encoding="utf-8")
    back = load_config(path)  # no preset: the file holds every value itself
    stage = "ppo" if name in PRESETS else name
    want = load_config(None, [], name if name in PRESETS else None)
    for section in STAGE_SECTIONS[stage]:
        got_s, want_s = to_dict(getattr(back, section)), to_dict(getattr(want, section))
        differ = {k for k in got_s if got_s[k] != want_s[k]}
        # only the starter's examples differ from the preset's/defaults' values
        assert differ <= {"output_dir", "policy", "train", "eval", "function"}, (section, differ)
    if name in PRESETS:
        for dotted, value in PRESETS[name].items():
            section, *rest = dotted.split(".")
            got = getattr(back, section)
            for part in rest:
                got = getattr(got, part)
            assert got == value, dotted


def test_a_preset_lies_under_the_file_and_the_overrides(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("ppo:\n  samples_per_prompt: 4\n  kl_coef: 0.02\n", encoding="utf-8")
    cfg = load_config(path, ["generation.temperature=0.9"], "grpo")
    assert cfg.ppo.estimator == "grpo" and cfg.ppo.kl_placement == "loss"  # the preset's
    assert cfg.ppo.samples_per_prompt == 4 and cfg.ppo.kl_coef == 0.02  # the file's
    assert cfg.generation.temperature == 0.9  # the override's
    assert Config().ppo.estimator == "gae"  # without a preset: PPO as before


def test_grpo_command_is_ppo_with_the_grpo_preset(monkeypatch, tmp_path):
    seen = []
    data = tmp_path / "d.jsonl"  # the CLI checks the stage's local inputs before the api
    data.write_text('{"prompt": "p"}\n')
    required = [f"model.policy={tmp_path}", f"data.train={data}", "reward.function=m:f"]

    class FakeApi:
        @staticmethod
        def run(stage, cfg):
            seen.append((stage, cfg))
            return {}

        @staticmethod
        def close():
            pass

    import rlhf_dist

    monkeypatch.setattr(rlhf_dist, "api", FakeApi, raising=False)
    monkeypatch.setitem(__import__("sys").modules, "rlhf_dist.api", FakeApi)
    assert cli.main(["grpo", *required, "ppo.iterations=3"]) == 0
    assert cli.main(["ppo", "--preset", "grpo", *required, "ppo.iterations=3"]) == 0
    (stage_a, a), (stage_b, b) = seen
    assert stage_a == stage_b == "ppo" and a == b
    assert a.ppo.estimator == "grpo" and a.ppo.samples_per_prompt == 8 and a.ppo.iterations == 3
