"""The front door: every shipped config and the defaults validate on 1, 2, 8 and 16 ranks;
presets lie under the user's keys; `rlhf-dist grpo` is `rlhf-dist ppo` with the grpo
preset; `rlhf-dist config --yaml STAGE` writes a file that reads back to the same Config.
All torch-free: validation happens before any model loads."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from rlhf_dist import cli
from rlhf_dist.config import Config, load_config, starter_yaml, to_dict, validate
from rlhf_dist.config.presets import PRESETS
from rlhf_dist.config.starter import STAGE_SECTIONS
from rlhf_dist.config.views import is_read, unread_keys
from rlhf_dist.names import ESTIMATORS

CONFIGS = Path(__file__).resolve().parents[2] / "launch" / "configs"
WORLD_SIZES = (1, 2, 8, 16)
# what a run needs besides the defaults: a model, data and (PPO) a reward
REQUIRED = ["model.policy=/m", "data.train=/d.jsonl", "reward.function=m:f"]
CRITIC_FREE = [
    name for name in PRESETS if not ESTIMATORS[PRESETS[name]["ppo.estimator"]].needs_critic
]


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
    # a critic-free preset's file leaves the critic's keys out, and still reads back the same
    keys = dotted_keys(yaml.safe_load(path.read_text()))
    critic_keys = [k for k in keys if CRITIC_ONLY.search(k)]
    assert bool(critic_keys) == (name in ("ppo", "iterate")), critic_keys
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
        def run_validated(stage, cfg):
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


def dotted_keys(tree: dict, prefix: str = "") -> list[str]:
    """Every dotted key of a nested YAML tree, leaves and sections."""
    out = []
    for name, value in tree.items():
        out.append(f"{prefix}{name}")
        if isinstance(value, dict):
            out += dotted_keys(value, f"{prefix}{name}.")
    return out


# A key name that only a critic-based estimator reads (GAE's gamma and lambda, the value
# loss and its clip, the critic's optimizer, start and LoRA): matched on dotted key names,
# so dpo.simpo_gamma or reward.judge_fallback_score would not count (not in a PPO file anyway).
CRITIC_NAME = re.compile(r"(^|\.)(gamma|lam)$|(^|\.)vf_|critic|(^|\.)value")
# Those a critic-free estimator never reads (REINFORCE++ discounts with gamma).
CRITIC_ONLY = re.compile(r"(^|\.)lam$|(^|\.)vf_|critic|(^|\.)value")


@pytest.mark.parametrize("name", CRITIC_FREE)
def test_config_yaml_of_a_critic_free_preset_has_no_gae_critic_or_value_key(name, capsys):
    assert cli.main(["config", "--yaml", name]) == 0
    keys = dotted_keys(yaml.safe_load(capsys.readouterr().out))
    assert "ppo.estimator" in keys and "ppo.clip_eps" in keys  # the file is whole otherwise
    assert [k for k in keys if CRITIC_ONLY.search(k)] == []
    assert ("ppo.gamma" in keys) == name.startswith("reinforce_pp")  # its return-to-go


def test_config_yaml_grpo_has_no_gae_critic_or_value_key_and_ppo_keeps_them(capsys):
    assert cli.main(["config", "--yaml", "grpo"]) == 0
    grpo = dotted_keys(yaml.safe_load(capsys.readouterr().out))
    assert [k for k in grpo if CRITIC_NAME.search(k)] == []
    assert "ppo.grpo_std_normalize" in grpo and "ppo.whiten_advantages" in grpo
    assert cli.main(["config", "--yaml", "ppo"]) == 0
    ppo = dotted_keys(yaml.safe_load(capsys.readouterr().out))
    wanted = {"ppo.gamma", "ppo.lam", "ppo.vf_coef", "ppo.value_clip_eps", "ppo.critic_init",
              "ppo.critic_optim", "ppo.critic_optim.lr", "lora.critic"}  # fmt: skip
    assert wanted <= set(ppo)
    assert "ppo.grpo_std_normalize" not in ppo and "ppo.dpo_loss" not in ppo  # gae reads neither
    # REINFORCE++ discounts its return-to-go with gamma, but has no critic
    assert cli.main(["config", "--yaml", "reinforce_pp"]) == 0
    rpp = dotted_keys(yaml.safe_load(capsys.readouterr().out))
    assert "ppo.gamma" in rpp and "ppo.lam" not in rpp and "ppo.vf_coef" not in rpp


def test_config_of_a_preset_lists_the_keys_it_reads_with_its_values(capsys):
    assert cli.main(["config", "grpo"]) == 0
    text = capsys.readouterr().out
    listed = re.findall(r"^  ([a-z_0-9.]+)  ", text, re.MULTILINE)
    assert "ppo.estimator" in listed and "ppo.samples_per_prompt" in listed
    assert [k for k in listed if CRITIC_NAME.search(k)] == []
    assert '  ppo.estimator  str = "grpo"' in text  # the preset's value as the default
    assert cli.main(["config", "ppo"]) == 0  # a section, as before: every key of it
    assert "  ppo.vf_coef  float" in capsys.readouterr().out


def test_which_estimators_read_a_key_is_declared_on_the_key():
    """needs= names a trait of algo/catalog.py, estimators= known estimators; the view of
    each preset leaves out exactly the keys its estimator does not read."""
    from rlhf_dist.config.loading import _walk

    for name, f, _, _ in _walk(Config()):
        assert set(f.metadata.get("estimators", ())) <= set(ESTIMATORS), name
    grpo = load_config(None, [], "grpo")
    # a subsection goes whole (is_read: ppo.critic_optim.lr with it)
    assert unread_keys(grpo, "ppo") == {
        "ppo.critic_optim", "ppo.critic_init", "ppo.value_clip_eps", "ppo.vf_coef",
        "ppo.gamma", "ppo.lam", "ppo.dpo_loss", "lora.critic",
    }  # fmt: skip
    assert not is_read("ppo.critic_optim.lr", unread_keys(grpo, "ppo"))
    assert unread_keys(Config(), "ppo") == {"ppo.grpo_std_normalize", "ppo.dpo_loss"}
    assert unread_keys(Config(), "sft") == {"lora.critic"}  # read by the PPO loop alone


def test_a_command_validates_its_config_once(monkeypatch, tmp_path):
    """cli validates before torch loads and hands the validated config to the api, which
    does not validate it again (only a config run.auto_fit derives is)."""
    from types import SimpleNamespace

    from rlhf_dist import api, config

    calls, real = [], config.validate

    def counting(cfg, stage, world_size=1, **kw):
        calls.append(stage)
        return real(cfg, stage, world_size, **kw)

    monkeypatch.setattr(config, "validate", counting)
    monkeypatch.setattr(api, "validate", counting)
    monkeypatch.setattr(api, "_runtime", lambda cfg: None)
    monkeypatch.setattr(api, "_planned", lambda cfg, stage, runtime: cfg)
    runner = SimpleNamespace(train_ppo=lambda cfg, runtime: {"ran": True})
    monkeypatch.setattr(api, "importlib", SimpleNamespace(import_module=lambda name: runner))
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "p"}\n')
    required = [f"model.policy={tmp_path}", f"data.train={data}", "reward.function=m:f"]
    assert cli.main(["grpo", *required]) == 0
    assert calls == ["ppo"]
    # the Python API validates what it is given, once too
    calls.clear()
    assert api.run("ppo", load_config(None, required, "grpo")) == {"ran": True}
    assert calls == ["ppo"]
    # and a config error still ends as one line and exit 2, before anything runs
    assert cli.main(["grpo", *required, "ppo.samples_per_prompt=1"]) == 2
