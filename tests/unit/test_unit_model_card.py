"""The model card written beside every export (observability/model_card.py) and the config
checks of run.push_to_hub: what the hub reads (front matter, parsed by huggingface_hub's own
ModelCard) and what a reader needs (algorithm, base model, data, settings, results, loading)."""

from __future__ import annotations

import pytest
from huggingface_hub import ModelCard

from rlhf_dist.config import ConfigError, config_from_dict, to_dict, validate
from rlhf_dist.names import ESTIMATORS
from rlhf_dist.observability import model_card as mc


def facts(stage="ppo", kind="policy", tree=None, **extra) -> mc.CardFacts:
    values = {
        "stage": stage,
        "kind": kind,
        "config": tree or to_dict(config_from_dict({"data": {"train": "trl-lib/tldr"}})),
        "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "base_on_hub": True,
        "hub_datasets": ("trl-lib/tldr",),
        "metrics": {"iterations": 10, "score": 0.123456, "kl": 1.5, "first_score": None},
        "date": "2025-01-02",
        "load_from": "runs/x/final",
    }
    return mc.CardFacts(**(values | extra))


def test_front_matter_is_what_the_hub_reads():
    tree = to_dict(config_from_dict({"ppo": {"estimator": "grpo"}}))
    card = ModelCard(mc.card_text(facts(tree=tree)))
    assert card.data.to_dict() == {
        "library_name": "transformers",
        "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "tags": ["rlhf_dist", "grpo"],
        "datasets": ["trl-lib/tldr"],
    }


def test_a_local_base_model_and_local_data_stay_out_of_the_metadata():
    # The hub rejects a base_model that is not a hub model; a path is for the text only.
    text = mc.card_text(
        facts(stage="sft", base_model="/data/sft", base_on_hub=False, hub_datasets=())
    )
    meta = ModelCard(text).data.to_dict()
    assert "base_model" not in meta and "datasets" not in meta
    assert meta["tags"] == ["rlhf_dist", "sft"]
    assert "**Base model**: `/data/sft`" in text


@pytest.mark.parametrize(
    "stage, section, expected",
    [
        ("dpo", {"dpo": {"loss_type": "ipo"}}, ("IPO", "ipo")),
        ("dpo", {"dpo": {"loss_type": "simpo"}}, ("SimPO (reference-free)", "simpo")),
        ("dpo", {"dpo": {"loss_type": "orpo"}}, ("ORPO (reference-free)", "orpo")),
        ("dpo", {"dpo": {"label_smoothing": 0.1}}, ("conservative DPO", "dpo")),
        ("dpo", {}, ("DPO", "dpo")),
        ("kto", {}, ("KTO", "kto")),
        ("rm", {}, ("the Bradley-Terry loss on preference pairs", "reward-model")),
        ("ppo", {"ppo": {"estimator": "gae"}}, ("PPO with GAE (actor-critic)", "ppo")),
        ("ppo", {"ppo": {"estimator": "rloo"}}, ("RLOO", "rloo")),
    ],
)
def test_algorithm_named_from_the_config(stage, section, expected):
    assert mc.algorithm(stage, to_dict(config_from_dict(section))) == expected


def test_every_estimator_has_a_name_and_tag():
    assert set(mc.ESTIMATORS) == set(ESTIMATORS)


def test_every_card_key_is_a_config_key():
    tree = to_dict(config_from_dict({}))
    for keys in (*mc.STAGE_KEYS.values(), mc.COMMON_KEYS, mc.LORA_KEYS):
        for dotted in keys:
            mc.lookup(tree, dotted)  # KeyError: a renamed key the card would not show


def test_settings_table_has_the_run_defining_values_and_skips_empty_ones():
    tree = to_dict(
        config_from_dict(
            {"ppo": {"estimator": "grpo", "kl_coef": 0.02}, "reward": {"function": "m:f"}}
        )
    )
    text = mc.card_text(facts(tree=tree))
    assert "| `ppo.estimator` | grpo |" in text and "| `ppo.kl_coef` | 0.02 |" in text
    assert "| `reward.function` | m:f |" in text
    assert "`reward.url`" not in text and "`reward.judge`" not in text  # empty, none
    assert "`lora.r`" not in text  # LoRA off
    assert "config.yaml" in text
    lora = to_dict(config_from_dict({"lora": {"enabled": True, "r": 8}}))
    assert "| `lora.r` | 8 |" in mc.card_text(facts(tree=lora))


def test_results_are_the_summary_numbers():
    text = mc.card_text(facts(metrics={"score": 0.123456, "kl": 1.5, "nested": {"a": 1}}))
    assert "| `score` | 0.1235 |" in text and "| `kl` | 1.5 |" in text
    assert "nested" not in text


@pytest.mark.parametrize(
    "kind, lines",
    [
        ("policy", ["model = AutoModelForCausalLM.from_pretrained('me/m')"]),
        ("reward", ["model = AutoModelForSequenceClassification.from_pretrained('me/m')"]),
        (
            "critic",
            [
                "model = AutoModelForSequenceClassification.from_pretrained('me/m', subfolder='critic')"
            ],
        ),
        (
            "adapter",
            [
                "base = AutoModelForCausalLM.from_pretrained('HuggingFaceTB/SmolLM2-135M-Instruct')",
                "model = PeftModel.from_pretrained(base, 'me/m', subfolder='adapter')",
            ],
        ),
    ],
)
def test_how_to_load_each_kind(kind, lines):
    subfolder = {"critic": "critic", "adapter": "adapter"}.get(kind, "")
    text = mc.card_text(facts(kind=kind, load_from="me/m", subfolder=subfolder))
    for line in lines:
        assert line in text
    library = ModelCard(text).data.to_dict()["library_name"]
    assert library == ("peft" if kind == "adapter" else "transformers")


# ---------------------------------------------------------------- run.push_to_hub checks


def test_push_to_hub_without_a_repo_id_names_the_key():
    cfg = config_from_dict({"run": {"push_to_hub": True}, "model": {"policy": "p"},
                            "data": {"train": "d.jsonl"}})  # fmt: skip
    with pytest.raises(ConfigError, match=r"^run.hub_model_id: required"):
        validate(cfg, "sft")


def test_push_to_hub_with_a_bad_repo_id_names_the_key(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "t")
    cfg = config_from_dict({"run": {"push_to_hub": True, "hub_model_id": "a/b/c"},
                            "model": {"policy": "p"}, "data": {"train": "d.jsonl"}})  # fmt: skip
    with pytest.raises(ConfigError, match=r"^run.hub_model_id: 'a/b/c' is not a hub repo id"):
        validate(cfg, "sft")


def test_push_to_hub_without_a_token_fails_before_training(monkeypatch):
    import huggingface_hub

    monkeypatch.delenv("MY_HUB_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)  # no saved login either
    tree = {"run": {"push_to_hub": True, "hub_model_id": "me/m", "hub_token_env": "MY_HUB_TOKEN"},
            "model": {"policy": "p"}, "data": {"train": "d.jsonl"}}  # fmt: skip
    with pytest.raises(ConfigError, match=r"^run.hub_token_env: .*\$MY_HUB_TOKEN"):
        validate(config_from_dict(tree), "sft")
    monkeypatch.setenv("MY_HUB_TOKEN", "hf_x")
    validate(config_from_dict(tree), "sft")  # with the token: nothing to say


class _Rank:
    """A runtime stand-in for one rank of several: the gathered list is what every rank
    would receive (the main process's entry first)."""

    def __init__(self, is_main: bool, gathered: list[str]):
        self.is_main, self.gathered, self.calls = is_main, gathered, 0

    def gather_objects(self, items):
        self.calls += 1
        return self.gathered

    def print(self, *args):
        pass


def test_a_failed_upload_stops_every_rank_together(tmp_path):
    from rlhf_dist.errors import UserError
    from rlhf_dist.trainers.publish import publish

    tree = {"run": {"output_dir": str(tmp_path), "push_to_hub": True, "hub_model_id": "me/m"}}
    cfg = config_from_dict(tree)
    rank = _Rank(is_main=False, gathered=["run.push_to_hub: uploading x failed", ""])
    with pytest.raises(UserError, match="^run.push_to_hub: uploading x failed$"):
        publish(cfg, rank, tmp_path, "sft", {})
    assert rank.calls == 1 and not list(tmp_path.iterdir())  # only the main process writes
    publish(cfg, _Rank(is_main=False, gathered=["", ""]), tmp_path, "sft", {})  # pushed: go on
    quiet = _Rank(is_main=False, gathered=[])
    publish(config_from_dict({}), quiet, tmp_path, "sft", {})
    assert quiet.calls == 0  # no push: no collective
