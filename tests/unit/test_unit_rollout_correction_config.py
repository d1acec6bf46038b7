"""ppo.rollout_correction, ppo.max_staleness and the old ppo.tis_cap: each bad combination is
one ConfigError naming its key (config/validation.py); the old key still works."""

import pytest

from rlhf_dist.config import config_from_dict, validate
from rlhf_dist.errors import ConfigError

SERVER = {"backend": "server", "server_urls": ["http://127.0.0.1:1"]}


def _tree(generation=None, **ppo):
    return {
        "model": {"policy": "p", "reward": "r"},
        "data": {"train": "t.jsonl"},
        "generation": generation or {},
        "ppo": ppo,
    }


@pytest.mark.parametrize(
    "tree, message",
    [
        (_tree(rollout_correction="mis"), r"^ppo.rollout_correction: needs generation.backend"),
        (
            _tree(SERVER, rollout_correction="icepop", rollout_correction_level="sequence"),
            r"^ppo.rollout_correction_level: icepop masks tokens",
        ),
        (
            _tree(SERVER, rollout_correction="icepop", rollout_correction_low=3.0),
            r"^ppo.rollout_correction_low: must be below ppo.rollout_correction_high \(2\)",
        ),
        (
            _tree(SERVER, rollout_correction="tis", rollout_correction_low=0.2),
            r"^ppo.rollout_correction_low: only icepop reads it",
        ),
        (_tree(max_staleness=1), r"^ppo.max_staleness: needs generation.backend=server \(with hf"),
        (
            _tree({"backend": "vllm"}, max_staleness=1),
            r"^ppo.max_staleness: needs generation.backend=server \(with vllm",
        ),
        (
            _tree(
                SERVER,
                max_staleness=1,
                estimator="grpo",
                samples_per_prompt=2,
                dynamic_sampling=True,
            ),
            r"^ppo.dynamic_sampling: true needs ppo.max_staleness=0",
        ),
        (_tree(SERVER, tis_cap=-1), r"^ppo.tis_cap: must be > 0 or null, got -1"),
        (
            _tree(SERVER, tis_cap=2.0, rollout_correction="mis"),
            r"^ppo.tis_cap: replaced by ppo.rollout_correction=tis",
        ),
    ],
)
def test_bad_combinations_name_the_key(tree, message):
    with pytest.raises(ConfigError, match=message):
        validate(config_from_dict(tree), "ppo")


def test_good_combinations_and_the_old_key(capsys):
    cfg = config_from_dict(_tree(SERVER, max_staleness=1, rollout_correction="icepop"))
    validate(cfg, "ppo")
    assert cfg.ppo.max_staleness == 1 and cfg.ppo.rollout_correction == "icepop"
    validate(config_from_dict(_tree(SERVER, max_staleness=4)), "ppo")  # k steps off
    cfg = config_from_dict(_tree(SERVER, tis_cap=3.0))
    validate(cfg, "ppo")
    p = cfg.ppo
    assert (p.rollout_correction, p.rollout_correction_level, p.rollout_correction_high) == (
        "tis", "token", 3.0,
    )  # fmt: skip
    assert "ppo.tis_cap is now ppo.rollout_correction=tis" in capsys.readouterr().err
    off = config_from_dict(_tree(tis_cap=None))  # null: off, as it was
    validate(off, "ppo")
    assert off.ppo.rollout_correction == "none"
