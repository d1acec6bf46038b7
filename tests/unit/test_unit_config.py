"""Unit tests of rlhf_dist.config: YAML + `section.key=value` overrides, validation, save/load.

The contract (config.py docstring, docs/architecture.md section 3): every user mistake is a
`ConfigError` whose message is ONE line and names the key; config objects are frozen.
"""

import dataclasses
import math

import pytest
import yaml

from rlhf_dist.config import (
    Config,
    ConfigError,
    OptimConfig,
    describe,
    load_config,
    save_config,
    validate,
)

# Enough for validate() to reach the checks under test at each stage.
PPO_REQUIRED = ["model.policy=/p", "data.train=/d.jsonl", "reward.function=m:f"]
SFT_REQUIRED = ["model.policy=/p", "data.train=/d.jsonl"]


def config_error(fn, *args, **kwargs) -> str:
    """Run fn, require a ConfigError, and return its message after checking it is one line."""
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert message.strip(), "empty error message"
    assert "\n" not in message and "\r" not in message, f"multi-line message: {message!r}"
    return message


def write(tmp_path, text: str, name: str = "cfg.yaml"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# ------------------------------------------------------------------------------- loading


def test_defaults_without_file_or_overrides():
    assert load_config() == Config()


def test_yaml_file_sets_nested_values(tmp_path):
    path = write(
        tmp_path,
        "run:\n  seed: 7\n  trackers: [wandb, tensorboard]\n"
        "ppo:\n  kl_coef: 0.2\n  actor:\n    lr: 3e-6\n"
        "reward:\n  missing_eos_penalty: -1\n",
    )
    cfg = load_config(path)
    assert cfg.run.seed == 7
    assert cfg.run.trackers == ("wandb", "tensorboard")
    assert cfg.ppo.kl_coef == 0.2
    # PyYAML (YAML 1.1) reads `3e-6` as a string; the loader must still make it a float.
    assert cfg.ppo.optim.lr == 3e-6 and isinstance(cfg.ppo.optim.lr, float)
    # An int where a float is declared is widened, not rejected.
    assert cfg.reward.missing_eos_penalty == -1.0
    assert isinstance(cfg.reward.missing_eos_penalty, float)
    # Keys not in the file keep their defaults, including the section-specific ones.
    assert cfg.ppo.critic_optim == Config().ppo.critic_optim
    assert cfg.ppo.iterations == Config().ppo.iterations


def test_overrides_parse_like_yaml():
    cfg = load_config(
        overrides=[
            "ppo.optim.lr=1e-5",
            "ppo.critic_optim.lr=2.5e-4",
            "ppo.iterations=3",
            "ppo.whiten_advantages=false",
            "run.trackers=[wandb]",
            "run.output_dir=runs/x",
            "reward.missing_eos_penalty=-1",
        ]
    )
    assert cfg.ppo.optim.lr == 1e-5 and isinstance(cfg.ppo.optim.lr, float)
    assert cfg.ppo.critic_optim.lr == 2.5e-4
    assert cfg.ppo.iterations == 3
    assert cfg.ppo.whiten_advantages is False
    assert cfg.run.trackers == ("wandb",)
    assert cfg.run.output_dir == "runs/x"
    assert cfg.reward.missing_eos_penalty == -1.0


def test_nested_override_keeps_the_section_specific_defaults():
    # ppo.optim defaults to lr=3e-6, not OptimConfig's 1e-4: touching one key of the
    # nested section must not reset its siblings to the generic dataclass defaults.
    cfg = load_config(overrides=["ppo.optim.weight_decay=0.1", "sft.optim.warmup_steps=5"])
    assert cfg.ppo.optim.weight_decay == 0.1
    assert cfg.ppo.optim.lr == Config().ppo.optim.lr == 3e-6
    assert cfg.sft.optim.lr == Config().sft.optim.lr == 2e-5
    assert cfg.sft.optim.warmup_steps == 5
    assert OptimConfig().lr != 1e-5  # otherwise the check above would prove nothing


def test_null_override_for_optional_values(tmp_path):
    path = write(tmp_path, "reward:\n  missing_eos_penalty: -1\n  clip: 5\n")
    cfg = load_config(path, ["reward.missing_eos_penalty=null", "ppo.value_clip_eps=None"])
    assert cfg.reward.missing_eos_penalty is None
    assert cfg.ppo.value_clip_eps is None
    assert cfg.reward.clip == 5.0  # untouched by the overrides


def test_overrides_apply_after_the_file_in_order(tmp_path):
    path = write(tmp_path, "run:\n  seed: 1\nppo:\n  kl_coef: 0.3\n")
    cfg = load_config(path, ["run.seed=2", "run.seed=3"])
    assert cfg.run.seed == 3
    assert cfg.ppo.kl_coef == 0.3


def test_empty_yaml_file_gives_defaults(tmp_path):
    assert load_config(write(tmp_path, "")) == Config()


# --------------------------------------------------------------------- errors: one line


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["nonsense.key=1"], "nonsense"),
        (["typo=1"], "typo"),
        (["ppo.kl_coeff=0.1"], "ppo.kl_coeff"),
        (["ppo.optim.learning_rate=1e-5"], "ppo.optim.learning_rate"),
    ],
)
def test_unknown_keys(overrides, key):
    message = config_error(load_config, None, overrides)
    assert message.startswith(key + ":"), message
    assert "unknown" in message


def test_unknown_key_in_yaml_file(tmp_path):
    path = write(tmp_path, "ppo:\n  actor:\n    lr: 1e-5\n    betas: [0.9, 0.95]\n")
    message = config_error(load_config, path)
    assert "ppo.optim.betas" in message


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("ppo.iterations=ten", "ppo.iterations"),  # int given text
        ("ppo.iterations=2.5", "ppo.iterations"),  # int given a float
        ("run.seed=true", "run.seed"),  # bool is not an int here
        ("ppo.whiten_advantages=3", "ppo.whiten_advantages"),  # bool given an int
        ("ppo.whiten_advantages=yes please", "ppo.whiten_advantages"),
        ("ppo.kl_coef=[0.1, 0.2]", "ppo.kl_coef"),  # float given a list
        ("ppo.kl_coef=abc", "ppo.kl_coef"),  # float given text that is no number
        ("ppo.clip_eps=true", "ppo.clip_eps"),
        ("run.trackers=[1, 2]", "run.trackers"),  # list of non-text
        ("model.policy=null", "model.policy"),  # not optional
        ("ppo.optim=3", "ppo.optim"),  # a section given a scalar
        ("ppo=3", "ppo"),
    ],
)
def test_wrong_types(override, key):
    message = config_error(load_config, None, [override])
    assert message.startswith(key + ":"), message


def test_wrong_type_in_yaml_file(tmp_path):
    path = write(tmp_path, "ppo:\n  ppo_epochs: [1, 2]\n")
    assert "ppo.ppo_epochs" in config_error(load_config, path)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("ppo.kl_kind=k4", "ppo.kl_kind"),
        ("ppo.kl_controller=pid", "ppo.kl_controller"),
        ("model.dtype=float16", "model.dtype"),
        ("data.too_long=wrap", "data.too_long"),
        ("sft.optim.schedule=step", "sft.optim.schedule"),
    ],
)
def test_values_outside_choices(override, key):
    message = config_error(load_config, None, [override])
    assert message.startswith(key + ":"), message
    assert "must be one of" in message


def test_malformed_override():
    assert "section.key=value" in config_error(load_config, None, ["ppo.kl_coef"])
    assert "section.key=value" in config_error(load_config, None, ["ppo..kl_coef=1"])


def test_invalid_yaml_file(tmp_path):
    path = write(tmp_path, "ppo:\n  kl_coef: [0.1\n  iterations: 3\n")
    message = config_error(load_config, path)
    assert str(path) in message and "invalid YAML" in message


def test_yaml_file_that_is_not_a_mapping(tmp_path):
    path = write(tmp_path, "- a\n- b\n")
    assert "mapping" in config_error(load_config, path)


def test_yaml_file_that_is_not_a_mapping_with_overrides(tmp_path):
    path = write(tmp_path, "- a\n- b\n")
    message = config_error(load_config, path, ["run.seed=1"])
    assert str(path) in message and "mapping" in message


def test_missing_and_unreadable_files(tmp_path):
    missing = tmp_path / "nope.yaml"
    message = config_error(load_config, missing)
    assert str(missing) in message and "cannot read" in message
    # A directory is a path that exists but cannot be read as a file.
    assert "cannot read" in config_error(load_config, tmp_path)


def test_non_utf8_config_file(tmp_path):
    path = tmp_path / "binary.yaml"
    path.write_bytes(b"\xff\xfe\x00run:\n  seed: 1\n")
    assert str(path) in config_error(load_config, path)


# ----------------------------------------------------------------------------- validate


def test_valid_configs_pass_every_stage():
    validate(load_config(overrides=PPO_REQUIRED), "ppo")
    validate(load_config(overrides=PPO_REQUIRED), "eval")
    validate(load_config(overrides=SFT_REQUIRED), "sft")
    validate(load_config(overrides=SFT_REQUIRED), "rm")
    # 64 prompts / 2 ranks, 16-sequence minibatches of 2 ranks x 8.
    cfg = load_config(overrides=[*PPO_REQUIRED, "ppo.micro_batch_size=8"])
    validate(cfg, "ppo", world_size=2)
    # The same config is refused where the world size does not split it: the calls above
    # passed because the checks hold, not because none ran.
    with pytest.raises(ConfigError, match=r"world size=3 must divide ppo.rollout_batch_size"):
        validate(cfg, "ppo", world_size=3)
    with pytest.raises(ConfigError, match=r"^model.policy: required"):
        validate(load_config(overrides=["data.train=t.jsonl"]), "sft")


def test_ppo_minibatch_must_divide_rollout_batch():
    cfg = load_config(
        overrides=[*PPO_REQUIRED, "ppo.rollout_batch_size=64", "ppo.minibatch_size=24"]
    )
    message = config_error(validate, cfg, "ppo")
    assert "ppo.minibatch_size" in message and "ppo.rollout_batch_size" in message


def test_minibatch_counts_sequences_with_several_samples_per_prompt():
    # 8 prompts x 4 samples = 32 sequences: a minibatch of 16 fits, 24 does not.
    base = [*PPO_REQUIRED, "ppo.rollout_batch_size=8", "ppo.samples_per_prompt=4"]
    validate(load_config(overrides=[*base, "ppo.minibatch_size=16"]), "ppo")
    cfg = load_config(overrides=[*base, "ppo.minibatch_size=24", "ppo.micro_batch_size=8"])
    message = config_error(validate, cfg, "ppo")
    assert message.startswith("ppo.minibatch_size") and "ppo.samples_per_prompt" in message


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["ppo.estimator=grpo"], "ppo.samples_per_prompt"),  # groups of 1
        (["ppo.estimator=rloo", "ppo.samples_per_prompt=1"], "ppo.samples_per_prompt"),
        (["ppo.samples_per_prompt=0"], "ppo.samples_per_prompt"),
        (
            [
                "ppo.estimator=grpo",
                "ppo.samples_per_prompt=2",
                "lora.enabled=true",
                "lora.critic=true",
            ],
            "lora.critic",
        ),
        (["ppo.clip_eps=null", "ppo.clip_eps_high=0.28"], "ppo.clip_eps_high"),
        (["ppo.clip_eps_low=0"], "ppo.clip_eps_low"),
        (["ppo.clip_eps_low=1.5"], "ppo.clip_eps_low"),
        (["ppo.dual_clip=1.0"], "ppo.dual_clip"),
        (["ppo.clip_eps=null", "ppo.dual_clip=3"], "ppo.dual_clip"),
        (["ppo.entropy_coef=-0.1"], "ppo.entropy_coef"),
    ],
)
def test_estimator_and_objective_combinations(overrides, key):
    cfg = load_config(overrides=[*PPO_REQUIRED, *overrides])
    assert config_error(validate, cfg, "ppo").startswith(key + ":")


GROUPS = ["ppo.estimator=grpo", "ppo.samples_per_prompt=4"]


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["ppo.policy_loss=cispo", "ppo.dual_clip=3"], "ppo.dual_clip"),
        (["ppo.clip_eps_low=1.0"], "ppo.clip_eps_low"),  # PPO's clip needs a lower bound
        (["ppo.policy_loss=cispo", "ppo.clip_eps_low=1.5"], "ppo.clip_eps_low"),
        (["ppo.ratio_level=seq"], "ppo.ratio_level"),
        (["ppo.policy_loss=reinforce"], "ppo.policy_loss"),
        (["ppo.overlong=cut"], "ppo.overlong"),
        (["ppo.dynamic_sampling=true"], "ppo.dynamic_sampling"),  # gae has no groups
        (["ppo.dynamic_sampling=true", "ppo.estimator=reinforce_pp"], "ppo.dynamic_sampling"),
        (
            [*GROUPS, "ppo.dynamic_sampling=true", "ppo.dynamic_sampling_max_rounds=0"],
            "ppo.dynamic_sampling_max_rounds",
        ),
        (
            [*GROUPS, "ppo.dynamic_sampling=true", "debug.overfit_one_batch=true"],
            "ppo.dynamic_sampling",
        ),
        (["ppo.overlong=soft", "ppo.overlong_buffer=0"], "ppo.overlong_buffer"),
        (
            ["ppo.overlong=soft", "ppo.overlong_buffer=33", "generation.max_new_tokens=32"],
            "ppo.overlong_buffer",
        ),
    ],
)
def test_gspo_cispo_dapo_keys_refuse_bad_combinations(overrides, key):
    try:
        cfg = load_config(overrides=[*PPO_REQUIRED, *overrides])
    except ConfigError as e:  # a value outside the key's choices fails at load
        assert str(e).startswith(key + ":")
        return
    assert config_error(validate, cfg, "ppo").startswith(key + ":")


@pytest.mark.parametrize(
    "overrides",
    [
        ["ppo.ratio_level=sequence", "ppo.loss_aggregation=seq_mean_token_mean"],
        ["ppo.policy_loss=cispo", "ppo.clip_eps_low=1.0", "ppo.clip_eps_high=0.28"],
        ["ppo.ratio_level=sequence", "ppo.policy_loss=cispo", "ppo.clip_eps=null"],
        [*GROUPS, "ppo.dynamic_sampling=true", "ppo.overlong=soft", "ppo.overlong_buffer=32"],
        ["ppo.estimator=rloo", "ppo.samples_per_prompt=2", "ppo.dynamic_sampling=true"],
        ["ppo.overlong=mask", "ppo.overlong_buffer=0"],  # the buffer is read by soft only
    ],
)
def test_gspo_cispo_dapo_keys_accept_good_combinations(overrides):
    cfg = load_config(overrides=[*PPO_REQUIRED, *overrides])
    validate(cfg, "ppo")
    for override in overrides:  # accepted as given: nothing was dropped or fixed up
        name, _, text = override.partition("=")
        value = getattr(cfg.ppo, name.removeprefix("ppo."))
        assert str(value).lower() == {"null": "none"}.get(text, text).lower(), override


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["ppo.ptx_coef=0.5"], "ppo.ptx_coef"),  # the coefficient without its rows
        (["data.ptx=sft.jsonl"], "data.ptx"),  # rows without a coefficient: ptx off
        (["data.ptx=sft.jsonl", "ppo.ptx_coef=-1"], "ppo.ptx_coef"),
        (["data.ptx=sft.jsonl", "ppo.ptx_coef=nan"], "ppo.ptx_coef"),
    ],
)
def test_ptx_keys_come_together(overrides, key):
    cfg = load_config(overrides=[*PPO_REQUIRED, *overrides])
    assert config_error(validate, cfg, "ppo").startswith(key + ":")


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        # the adaptive coefficient must start within its bounds
        (["ppo.entropy_target=1.0", "ppo.entropy_coef=0.5"], "ppo.entropy_coef"),
        (["ppo.entropy_target=0"], "ppo.entropy_target"),
        (["ppo.entropy_target=1.0", "ppo.entropy_coef_lr=0"], "ppo.entropy_coef_lr"),
        (["ppo.entropy_coef_max=0"], "ppo.entropy_coef_max"),
        (["ppo.cov_control=clip"], "ppo.cov_control"),
        (["ppo.cov_control=clip_cov", "ppo.cov_ratio=0.5"], "ppo.cov_ratio"),
        (["ppo.cov_control=clip_cov", "ppo.cov_ratio=0"], "ppo.cov_ratio"),
        (
            ["ppo.cov_control=clip_cov", "ppo.cov_clip_low=5", "ppo.cov_clip_high=1"],
            "ppo.cov_clip_high",
        ),
        (["ppo.cov_control=clip_cov", "ppo.cov_clip_high=inf"], "ppo.cov_clip_high"),
        # KL-Cov's |log ratio| is 0 without gradient at a rollout's only optimizer step
        ([*GROUPS, "ppo.cov_control=kl_cov"], "ppo.cov_control"),
        (["ppo.cov_control=kl_cov", "ppo.ppo_epochs=1"], "ppo.cov_control"),
        (["ppo.cov_control=kl_cov", "ppo.cov_kl_coef=0"], "ppo.cov_kl_coef"),
    ],
)
def test_entropy_control_keys_refuse_bad_combinations(overrides, key):
    try:
        cfg = load_config(overrides=[*PPO_REQUIRED, *overrides])
    except ConfigError as e:  # a value outside the key's choices fails at load
        assert str(e).startswith(key + ":")
        return
    assert config_error(validate, cfg, "ppo").startswith(key + ":")


@pytest.mark.parametrize(
    "overrides",
    [
        ["ppo.entropy_target=0.5", "ppo.entropy_coef=0.01", "ppo.entropy_coef_max=0.05"],
        ["ppo.cov_control=kl_cov"],  # gae: 4 epochs per rollout
        [*GROUPS, "ppo.cov_control=kl_cov", "ppo.ppo_epochs=2"],
        [*GROUPS, "ppo.cov_control=kl_cov", "ppo.minibatch_size=2"],
        [*GROUPS, "ppo.cov_control=clip_cov", "ppo.cov_ratio=0.1", "ppo.cov_clip_low=-1"],
    ],
)
def test_entropy_control_keys_accept_good_combinations(overrides):
    cfg = load_config(overrides=[*PPO_REQUIRED, *overrides])
    validate(cfg, "ppo")
    for override in overrides:  # accepted as given: nothing was dropped or fixed up
        name, _, text = override.partition("=")
        assert getattr(cfg.ppo, name.removeprefix("ppo.")) == yaml.safe_load(text), override


def test_ptx_is_off_by_default_and_accepted_with_its_rows():
    cfg = load_config(overrides=PPO_REQUIRED)
    assert cfg.ppo.ptx_coef == 0 and cfg.data.ptx == ""
    cfg = load_config(overrides=[*PPO_REQUIRED, "data.ptx=sft.jsonl", "ppo.ptx_coef=0.5"])
    validate(cfg, "ppo")
    assert (cfg.ppo.ptx_coef, cfg.data.ptx) == (0.5, "sft.jsonl")


def test_estimator_choices_come_from_the_registry():
    from rlhf_dist.names import ESTIMATORS  # the estimators and the objectives of their own

    for name in ESTIMATORS:
        samples = "2" if ESTIMATORS[name].needs_groups else "1"
        overrides = [f"ppo.estimator={name}", f"ppo.samples_per_prompt={samples}"]
        if name == "distill":  # distillation alone needs the model it distills from
            overrides.append("model.teacher=/t")
        validate(load_config(overrides=[*PPO_REQUIRED, *overrides]), "ppo")
    message = config_error(load_config, None, ["ppo.estimator=vtrace"])
    assert message.startswith("ppo.estimator:") and "grpo" in message


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["ppo.estimator=distill"], "model.teacher"),  # distillation alone, from nothing
        (["model.teacher=/t", "ppo.distill_coef=0"], "ppo.distill_coef"),  # teacher unused
        (["model.teacher=/t", "ppo.distill_coef=-1"], "ppo.distill_coef"),
        (["model.teacher=/t", "ppo.distill_loss=forward_kl"], "ppo.distill_loss"),
        (["model.teacher=/t", "ppo.distill_beta=1.5"], "ppo.distill_beta"),
    ],
)
def test_distillation_keys_refuse_bad_combinations(overrides, key):
    def load_and_validate():  # a choice is checked on loading, a combination on validation
        validate(load_config(overrides=[*PPO_REQUIRED, *overrides]), "ppo")

    assert config_error(load_and_validate).startswith(key + ":")


def test_distillation_alone_needs_no_reward_and_mixed_keeps_the_estimator():
    alone = ["model.policy=/p", "data.train=/d.jsonl", "model.teacher=/t", "ppo.estimator=distill"]
    validate(load_config(overrides=alone), "ppo")  # no model.reward or reward.function
    # without the teacher's estimator a task reward is still required
    plain = ["model.policy=/p", "data.train=/d.jsonl", "model.teacher=/t"]
    assert config_error(validate, load_config(overrides=plain), "ppo").startswith("model.reward:")
    mixed = [*PPO_REQUIRED, *GROUPS, "model.teacher=/t", "ppo.distill_coef=0.5"]
    mixed += ["ppo.distill_loss=gjsd", "ppo.distill_beta=0"]
    cfg = load_config(overrides=mixed)
    validate(cfg, "ppo")
    assert (cfg.ppo.estimator, cfg.ppo.distill_coef, cfg.ppo.distill_beta) == ("grpo", 0.5, 0.0)


def test_ppo_micro_batch_times_world_size_must_divide_minibatch():
    cfg = load_config(overrides=[*PPO_REQUIRED, "ppo.minibatch_size=16", "ppo.micro_batch_size=16"])
    validate(cfg, "ppo", world_size=1)  # 16 x 1 divides 16
    message = config_error(validate, cfg, "ppo", world_size=2)  # 16 x 2 does not
    assert "ppo.micro_batch_size" in message and "ppo.minibatch_size" in message


def test_ppo_world_size_must_divide_rollout_batch():
    cfg = load_config(
        overrides=[
            *PPO_REQUIRED,
            "ppo.rollout_batch_size=6",
            "ppo.minibatch_size=6",
            "ppo.micro_batch_size=1",
        ]
    )
    validate(cfg, "ppo", world_size=3)
    assert "ppo.rollout_batch_size" in config_error(validate, cfg, "ppo", world_size=4)


@pytest.mark.parametrize("stage", ["sft", "rm"])
def test_sft_rm_micro_batch_must_divide_batch(stage):
    bad = load_config(
        overrides=[*SFT_REQUIRED, f"{stage}.batch_size=12", f"{stage}.micro_batch_size=8"]
    )
    message = config_error(validate, bad, stage)
    assert f"{stage}.micro_batch_size" in message and f"{stage}.batch_size" in message
    ok = load_config(
        overrides=[*SFT_REQUIRED, f"{stage}.batch_size=12", f"{stage}.micro_batch_size=6"]
    )
    validate(ok, stage)
    # 6 per micro-batch on each of 4 ranks is 24 sequences, which does not divide 12.
    assert f"{stage}.batch_size" in config_error(validate, ok, stage, world_size=4)


@pytest.mark.parametrize("stage", ["sft", "rm", "dpo", "kto", "ppo"])
def test_micro_batch_tokens_is_off_by_default_and_refuses_a_negative_budget(stage):
    required = PPO_REQUIRED if stage == "ppo" else SFT_REQUIRED
    validate(load_config(overrides=[*required, f"{stage}.micro_batch_tokens=4096"]), stage)
    assert getattr(load_config(), stage).micro_batch_tokens == 0
    bad = load_config(overrides=[*required, f"{stage}.micro_batch_tokens=-1"])
    message = config_error(validate, bad, stage)
    assert message.startswith(f"{stage}.micro_batch_tokens:"), message


def test_sft_divisibility_message_states_the_users_value():
    cfg = load_config(overrides=[*SFT_REQUIRED, "sft.batch_size=32", "sft.micro_batch_size=32"])
    message = config_error(validate, cfg, "sft", world_size=2)
    assert "sft.micro_batch_size=64" not in message


@pytest.mark.parametrize(
    ("stage", "overrides", "key"),
    [
        ("sft", ["data.train=/d.jsonl"], "model.policy"),
        ("sft", ["model.policy=/p"], "data.train"),
        ("rm", ["model.policy=/p"], "data.train"),
        ("rm", ["data.train=/d.jsonl"], "model.reward"),
        ("ppo", ["data.train=/d.jsonl", "reward.function=m:f"], "model.policy"),
        ("ppo", ["model.policy=/p", "reward.function=m:f"], "data.train"),
        ("ppo", ["model.policy=/p", "data.train=/d.jsonl"], "model.reward"),
        ("eval", ["reward.function=m:f"], "model.policy"),
    ],
)
def test_required_keys_per_stage(stage, overrides, key):
    message = config_error(validate, load_config(overrides=overrides), stage)
    assert message.startswith(key + ":"), message


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("ppo.gamma=1.5", "ppo.gamma"),
        ("ppo.lam=-0.1", "ppo.lam"),
        ("ppo.clip_eps=0", "ppo.clip_eps"),
        ("ppo.kl_coef=-1", "ppo.kl_coef"),
        ("ppo.value_clip_eps=0", "ppo.value_clip_eps"),
        ("ppo.optim.lr=0", "ppo.optim.lr"),
        ("generation.top_p=0", "generation.top_p"),
        ("generation.top_k=-1", "generation.top_k"),
        ("generation.temperature=0", "generation.temperature"),
        ("run.trackers=[mlflow]", "run.trackers"),
        ("reward.function=no_colon", "reward.function"),
    ],
)
def test_ppo_range_checks(override, key):
    cfg = load_config(overrides=[*PPO_REQUIRED, override])
    assert key in config_error(validate, cfg, "ppo")


def test_nan_learning_rate_is_rejected():
    cfg = load_config(overrides=[*PPO_REQUIRED, "ppo.optim.lr=nan"])
    assert math.isnan(cfg.ppo.optim.lr)
    assert "ppo.optim.lr" in config_error(validate, cfg, "ppo")


# ------------------------------------------------------------------- save / frozen objects


def test_save_config_round_trip(tmp_path):
    cfg = load_config(
        overrides=[
            "ppo.optim.lr=1e-5",
            "ppo.critic_optim.lr=3.3e-7",
            "run.trackers=[wandb, tensorboard]",
            "reward.missing_eos_penalty=-1",
            "ppo.value_clip_eps=null",
            "data.train=/some/file.jsonl",
            "ppo.kl_horizon=12345.5",
        ]
    )
    path = save_config(cfg, tmp_path / "out" / "run")
    assert path == tmp_path / "out" / "run" / "config.yaml" and path.is_file()
    assert load_config(path) == cfg
    # No temporary file is left next to it.
    assert sorted(p.name for p in path.parent.iterdir()) == ["config.yaml"]
    # Saving again over an existing file works (atomic replace).
    assert load_config(save_config(Config(), path.parent)) == Config()


def test_config_objects_are_frozen():
    cfg = load_config(overrides=["ppo.iterations=3"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.ppo.iterations = 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.ppo.optim.lr = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.run = None
    assert cfg.ppo.iterations == 3


def test_flash_attention_without_the_package_is_an_error_naming_the_key(monkeypatch):
    import rlhf_dist.config.validation as config_module

    cfg = load_config(overrides=PPO_REQUIRED + ["model.attn_implementation=flash_attention_2"])
    monkeypatch.setattr(config_module, "_installed", lambda module: False)
    with pytest.raises(ConfigError, match=r"^model\.attn_implementation: .*flash-attn"):
        validate(cfg, "ppo")
    monkeypatch.setattr(config_module, "_installed", lambda module: module == "flash_attn")
    validate(cfg, "ppo")
    with pytest.raises(ConfigError, match=r"^model\.attn_implementation: must be one of"):
        load_config(overrides=["model.attn_implementation=flash"])


@pytest.mark.parametrize("stage", ["sft", "rm", "dpo", "kto", "ppo"])
def test_eval_every_needs_held_out_data(stage):
    required = PPO_REQUIRED if stage == "ppo" else SFT_REQUIRED
    cfg = load_config(overrides=[*required, "run.eval_every=5"])
    assert config_error(validate, cfg, stage).startswith("run.eval_every: 5 needs data.eval")
    validate(load_config(overrides=[*required, "run.eval_every=5", "data.eval=/e.jsonl"]), stage)
    negative = load_config(overrides=[*required, "run.eval_every=-1", "data.eval=/e.jsonl"])
    assert config_error(validate, negative, stage).startswith("run.eval_every")


@pytest.mark.parametrize("stage", ["sft", "ppo"])
def test_trackio_without_the_package_is_an_error_naming_the_key_and_extra(monkeypatch, stage):
    import rlhf_dist.config.validation as config_module

    required = PPO_REQUIRED if stage == "ppo" else SFT_REQUIRED
    cfg = load_config(overrides=[*required, "run.trackers=[tensorboard, trackio]"])
    assert cfg.run.trackers == ("tensorboard", "trackio")
    monkeypatch.setattr(config_module, "_installed", lambda module: module != "trackio")
    message = config_error(validate, cfg, stage)
    assert message.startswith("run.trackers: trackio needs") and "rlhf_dist[trackio]" in message
    monkeypatch.setattr(config_module, "_installed", lambda module: True)
    validate(cfg, stage)


# ---------------------------------------------------------------------------------- help


def _all_fields(cls, prefix=""):
    """(dotted name, field) of every field of every section reachable from `cls`."""
    for f in dataclasses.fields(cls):
        yield f"{prefix}{f.name}", f
        if dataclasses.is_dataclass(f.default):
            yield from _all_fields(type(f.default), f"{prefix}{f.name}.")


def test_every_key_and_section_has_help_text():
    names = [name for name, _ in _all_fields(Config)]
    assert "ppo.optim.lr" in names and "sft.optim.schedule" in names  # the walk reaches nests
    missing = [
        name
        for name, f in _all_fields(Config)
        if not (isinstance(f.metadata.get("help"), str) and f.metadata["help"].strip())
    ]
    assert missing == [], f"declare these with key(default, help): {missing}"


def test_describe_lists_every_key_with_type_default_choices_and_help():
    text = describe()
    for name, f in _all_fields(Config):
        assert name in text
        assert " ".join(f.metadata["help"].split()) in " ".join(text.split())
    lines = text.splitlines()
    # A nested section shows its own defaults (sft.optim.lr is 2e-5, OptimConfig's is 1e-4).
    assert "  sft.optim.lr  float = 2e-05  (> 0)" in lines
    assert "  ppo.optim.lr  float = 3e-06  (> 0)" in lines
    assert '  ppo.kl_kind  str = "k1"  (one of: k1, k2, k3)' in lines
    assert "  reward.clip  float or null = null  (> 0 or null)" in lines
    assert any(line.startswith("  lora.target_modules  list of str = [") for line in lines)


def test_describe_one_section_subsection_or_key():
    ppo = describe("ppo")
    assert "ppo.optim.lr" in ppo and "ppo.kl_coef" in ppo and "run.seed" not in ppo
    actor = describe("ppo.optim")
    assert (
        "ppo.optim.lr" in actor
        and "ppo.critic_optim.lr" not in actor
        and "ppo.kl_coef" not in actor
    )
    assert describe("ppo.kl_kind").splitlines()[0].startswith("  ppo.kl_kind  str")


@pytest.mark.parametrize("section", ["ppx", "ppo.act", "ppo.optim.lr.x"])
def test_describe_unknown_section_names_it(section):
    message = config_error(describe, section)
    assert message.startswith(f"{section}: ") and "ppo" in message


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("reward.retries=-1", "reward.retries"),
        ("reward.retry_delay_s=-0.5", "reward.retry_delay_s"),
        ("reward.retry_delay_s=inf", "reward.retry_delay_s"),
        ("reward.timeout_s=0", "reward.timeout_s"),
        ("reward.timeout_s=-3", "reward.timeout_s"),
    ],
)
def test_reward_failure_keys_out_of_range(override, key):
    for stage in ("ppo", "eval"):
        message = config_error(validate, load_config(overrides=[*PPO_REQUIRED, override]), stage)
        assert message.startswith(key + ":"), message


def test_reward_failure_keys_in_range():
    cfg = load_config(
        overrides=[
            *PPO_REQUIRED,
            "reward.retries=0",
            "reward.retry_delay_s=0",
            "reward.timeout_s=2.5",
        ]
    )
    validate(cfg, "ppo")
    assert (cfg.reward.retries, cfg.reward.retry_delay_s, cfg.reward.timeout_s) == (0, 0.0, 2.5)


# --------------------------------------------------------------- ranges declared with the key


def test_range_text_and_in_range_by_hand():
    from rlhf_dist.config import in_range, range_text

    assert range_text({"gt": 0}) == "> 0"
    assert range_text({"min": 0}) == ">= 0"
    assert range_text({"min": 0, "max": 1}) == "in [0, 1]"
    assert range_text({"gt": 0, "max": 1}) == "in (0, 1]"
    assert range_text({"min": 0, "lt": 0.5}) == "in [0, 0.5)"
    assert range_text({}) == "finite"
    assert in_range(1.0, {"min": 0, "max": 1}) and not in_range(1.0, {"min": 0, "lt": 1})
    assert in_range(0.0, {"min": 0}) and not in_range(0.0, {"gt": 0})
    assert not in_range(math.nan, {}) and not in_range(math.inf, {"gt": 0})


def ranged_keys():
    from rlhf_dist.config.loading import _walk

    return [(name, f, value) for name, f, _, value in _walk(Config()) if "range" in f.metadata]


def outside(bounds: dict, value):
    """A value just outside `bounds`, of the key's type (list keys: one bad item)."""
    if "min" in bounds:
        bad = bounds["min"] - 1
    elif "gt" in bounds:
        bad = bounds["gt"]
    elif "max" in bounds:
        bad = bounds["max"] + 1
    elif "lt" in bounds:
        bad = bounds["lt"]
    else:
        bad = math.nan
    return (bad,) if isinstance(value, tuple) else bad


def test_every_declared_range_is_enforced_naming_its_key():
    keys = ranged_keys()
    assert len(keys) > 80, len(keys)  # every key validate range-checked, and alerts
    for name, f, value in keys:
        section, _, leaf = name.rpartition(".")
        parts = section.split(".")
        bad = outside(f.metadata["range"], value)
        if isinstance(value, int) and not isinstance(bad, tuple) and math.isfinite(bad):
            bad = int(bad) if float(bad).is_integer() else bad
        obj = Config()
        chain = [obj]
        for p in parts:
            chain.append(getattr(chain[-1], p))
        new = dataclasses.replace(chain[-1], **{leaf: bad})
        for holder, p in zip(reversed(chain[:-1]), reversed(parts), strict=True):
            new = dataclasses.replace(holder, **{p: new})
        message = config_error(validate, new, "sft")
        assert message.startswith(f"{name}: "), (name, message)
        # and the default, inside its range, passes the same check
        from rlhf_dist.config import check_keys

        check_keys(obj)


def test_alerts_section_is_validated():
    cfg = load_config(overrides=[*SFT_REQUIRED, "alerts.clipfrac_max=1.5"])
    assert config_error(validate, cfg, "sft").startswith("alerts.clipfrac_max: must be in (0, 1]")
    cfg = load_config(overrides=[*SFT_REQUIRED, "alerts.window=0"])
    assert config_error(validate, cfg, "sft").startswith("alerts.window: must be >= 1")


def test_optional_ranged_keys_take_null_and_list_keys_each_item():
    validate(
        load_config(overrides=[*PPO_REQUIRED, "ppo.clip_eps=null", "reward.timeout_s=null"]), "ppo"
    )
    cfg = load_config(overrides=[*PPO_REQUIRED, "generation.stop_token_ids=[3,-1]"])
    assert (
        config_error(validate, cfg, "ppo")
        == "generation.stop_token_ids: each must be >= 0, got [3, -1]"
    )
    # the renamed ppo.tis_cap is checked as it is moved to ppo.rollout_correction_high
    with pytest.raises(ConfigError, match=r"^ppo.tis_cap: must be > 0 or null, got 0"):
        load_config(overrides=[*PPO_REQUIRED, "ppo.tis_cap=0"])


def test_config_listing_shows_ranges():
    lines = describe("ppo").splitlines()
    assert any(line.startswith("  ppo.gamma  float = 1.0  (in [0, 1])") for line in lines), lines
    assert "(each >= 0)" in describe("generation.stop_token_ids")
    assert "(one of: wandb, tensorboard, trackio)" in describe("run.trackers")


@pytest.mark.parametrize(
    ("old", "new", "value"),
    [
        ("ppo.actor.lr", "ppo.optim.lr", 3e-6),
        ("ppo.critic.max_grad_norm", "ppo.critic_optim.max_grad_norm", 0.5),
        ("run.num_threads", "perf.num_threads", 3),
        ("run.retain_host_memory", "perf.retain_host_memory", False),
        ("model.logprob_chunk_tokens", "perf.logprob_chunk_tokens", 64),
        ("model.packed_sequences", "perf.packed_sequences", True),
        ("model.shared_prompt_forward", "perf.shared_prompt_forward", False),
        ("distributed.gather_for_generation", "perf.gather_for_generation", False),
        ("distributed.gather_for_training", "perf.gather_for_training", "never"),
    ],
)
def test_renamed_keys_still_work_with_one_deprecation_line(old, new, value, capsys, tmp_path):
    """A key renamed in this release (config.RENAMED_KEYS) is accepted for one release,
    from an override and from a YAML file, with one stderr line naming the new key."""
    text = str(value).lower() if isinstance(value, bool) else str(value)
    for load in (
        lambda: load_config(None, [f"{old}={text}"]),
        lambda: load_config(write_yaml(tmp_path, old, value), []),
    ):
        cfg = load()
        section, *rest = new.split(".")
        got = getattr(cfg, section)
        for part in rest:
            got = getattr(got, part)
        assert got == value
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and old.rsplit(".", 1)[0] in err[0] and "renamed" in err[0], err
        assert new.rsplit(".", 1)[0] in err[0]


def write_yaml(tmp_path, dotted: str, value) -> str:
    tree: dict = {}
    node = tree
    *parents, last = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(tree))
    return str(path)


def test_a_renamed_key_given_under_both_names_is_an_error():
    with pytest.raises(ConfigError, match=r"^ppo.actor: renamed to ppo.optim; set only ppo.optim"):
        load_config(None, ["ppo.actor.lr=1e-6", "ppo.optim.lr=2e-6"])


def test_new_names_print_no_deprecation(capsys):
    load_config(None, ["ppo.optim.lr=1e-6", "perf.num_threads=2"])
    assert capsys.readouterr().err == ""


def test_lora_on_the_reward_model_stage_is_refused_naming_the_key():
    """rlhf-dist rm trains in full: lora.enabled there would be silently left off."""
    from rlhf_dist.config import config_from_dict
    from rlhf_dist.config.validation import validate
    from rlhf_dist.errors import ConfigError

    cfg = config_from_dict({"model": {"policy": "p"}, "lora": {"enabled": True}})
    with pytest.raises(ConfigError, match=r"^lora\.enabled: rlhf-dist rm trains"):
        validate(cfg, "rm", inputs=False)
    validate(cfg, "sft", inputs=False)  # the trained policy takes adapters
