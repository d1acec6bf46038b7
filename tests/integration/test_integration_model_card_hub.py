"""A model card (README.md) beside every export, and run.push_to_hub against a local
stand-in for the Hugging Face Hub (tests/http_stub.py: 127.0.0.1 only, started and stopped
by each test).

- SFT and RM: the card's metadata parses with huggingface_hub's ModelCard, its results are
  summary.json's numbers, and its "How to load" snippet, run as written, loads the export;
- PPO (GAE, LoRA, export both): final/, final_adapter/ and critic/ each get a card, and all
  three arrive in one hub repository (root, adapter/, critic/) byte for byte, with the token
  from run.hub_token_env sent as the bearer and written to no output file;
- DPO with a hub that refuses the upload: one UserError line, everything stays on disk;
- KTO: the card names KTO.
"""

from __future__ import annotations

import json
import re

import pytest
from http_stub import StubServer, committed_files, hub_answer
from huggingface_hub import ModelCard

from rlhf_dist.config import config_from_dict
from rlhf_dist.errors import UserError
from rlhf_dist.trainers.dpo import train_dpo
from rlhf_dist.trainers.kto import train_kto
from rlhf_dist.trainers.ppo import train_ppo

TOKEN = "hf_standin_token_0123456789"  # a made-up token the stand-in expects


def card(directory) -> tuple[dict, str]:
    """(metadata, text) of the README.md in `directory`."""
    text = (directory / "README.md").read_text(encoding="utf-8")
    return ModelCard(text).data.to_dict(), text


def load_snippet(text: str) -> dict:
    """Run the card's "How to load" code as written; returns its variables."""
    (code,) = re.findall(r"## How to load\n\n```python\n(.*?)```", text, re.S)
    scope: dict = {}
    exec(code, scope)
    return scope


def _summary(out) -> dict:
    return json.loads((out / "summary.json").read_text())


def test_sft_and_rm_exports_carry_a_card_that_loads_them(sft_run, rm_run):
    meta, text = card(sft_run.out / "final")
    assert meta == {"library_name": "transformers", "tags": ["rlhf_dist", "sft"]}  # local base
    assert f"**Base model**: `{sft_run.cfg.model.policy}`" in text
    assert f"**Training data** (`data.train`): `{sft_run.cfg.data.train}`" in text
    assert f"| `train_loss` | {_summary(sft_run.out)['train_loss']:.4g} |" in text
    assert "| `sft.epochs` | 3 |" in text
    assert type(load_snippet(text)["model"]).__name__ == "LlamaForCausalLM"

    meta, text = card(rm_run.out / "final")
    assert meta["tags"] == ["rlhf_dist", "reward-model"]
    summary = _summary(rm_run.out)
    for name in ("train_accuracy", "eval_accuracy"):
        assert f"| `{name}` | {summary[name]:.4g} |" in text
    assert f"**Evaluation data** (`data.eval`): `{rm_run.cfg.data.eval}`" in text
    assert type(load_snippet(text)["model"]).__name__ == "LlamaForSequenceClassification"


def _ppo_cfg(out, sft_run, rm_run, task_env, data_cfg, run=None, **sections):
    tree = {
        "run": {"output_dir": str(out), "seed": 0, **(run or {})},
        "model": {"policy": str(sft_run.out / "final"), "reward": str(rm_run.out / "final")},
        "data": data_cfg(train=str(task_env.prompts)),
        "generation": {"max_new_tokens": 8},
        "ppo": {"iterations": 1, "rollout_batch_size": 8, "rollout_micro_batch_size": 8,
                "ppo_epochs": 1, "minibatch_size": 8, "micro_batch_size": 8},
        **sections,
    }  # fmt: skip
    return config_from_dict(tree)


@pytest.mark.slow
def test_ppo_exports_get_cards_and_reach_the_hub(
    sft_run, rm_run, task_env, runtime, tmp_path, data_cfg, monkeypatch
):
    import huggingface_hub.constants

    out = tmp_path / "ppo"
    hub = {"push_to_hub": True, "hub_model_id": "me/tiny-ppo", "hub_token_env": "MY_HUB_TOKEN"}
    lora = {"enabled": True, "r": 4, "alpha": 8, "export": "both"}
    cfg = _ppo_cfg(out, sft_run, rm_run, task_env, data_cfg, hub, lora=lora)
    monkeypatch.setenv("MY_HUB_TOKEN", TOKEN)
    with StubServer(hub_answer, max_requests=32) as stub:
        # What HF_ENDPOINT sets when huggingface_hub is imported, for this process.
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", stub.url)
        summary = train_ppo(cfg, runtime)

    uploaded = committed_files(stub.requests)["me/tiny-ppo"]
    for folder, prefix in (("final", ""), ("final_adapter", "adapter/"), ("critic", "critic/")):
        local = {p.relative_to(out / folder).as_posix(): p.read_bytes()
                 for p in (out / folder).rglob("*") if p.is_file()}  # fmt: skip
        assert {prefix + name: data for name, data in local.items()} == {
            name: data for name, data in uploaded.items() if name.startswith(prefix)
            and (prefix or "/" not in name)
        }, folder  # fmt: skip
    assert {"model.safetensors", "adapter/adapter_config.json", "critic/model.safetensors"} <= set(
        uploaded
    )
    auth = [{k.lower(): v for k, v in h.items()}.get("authorization") for _, _, h in stub.requests]
    assert auth == [f"Bearer {TOKEN}"] * len(stub.requests)
    create = [b for p, b, _ in stub.requests if p == "/api/repos/create"]
    assert create == [{"name": "tiny-ppo", "organization": "me", "visibility": "public"}]
    for path in out.rglob("*"):
        assert not path.is_file() or TOKEN.encode() not in path.read_bytes(), path

    meta, text = card(out / "final")
    assert meta["tags"] == ["rlhf_dist", "ppo"]
    assert "with PPO with GAE (actor-critic)" in text
    assert f"| `score` | {summary['score']:.4g} |" in text
    assert "AutoModelForCausalLM.from_pretrained('me/tiny-ppo')" in text
    meta, text = card(out / "final_adapter")
    assert meta["library_name"] == "peft"
    assert "PeftModel.from_pretrained(base, 'me/tiny-ppo', subfolder='adapter')" in text
    meta, text = card(out / "critic")
    assert meta["tags"] == ["rlhf_dist", "ppo", "value-model"]
    # The critic started from the reward model (ppo.critic_init=reward).
    assert f"**Base model**: `{rm_run.out / 'final'}`" in text
    assert (
        "AutoModelForSequenceClassification.from_pretrained('me/tiny-ppo', subfolder='critic')"
        in text
    )


def _refusing_hub(path, body, headers):
    if "/commit/" in path:
        return 403, {"error": "You don't have the rights to push to this repository"}
    return hub_answer(path, body, headers)


def _pref_cfg(stage, out, sft_run, data, run=None):
    return config_from_dict(
        {
            "run": {"output_dir": str(out), "seed": 0, **(run or {})},
            "model": {"policy": str(sft_run.out / "final")},
            "data": data,
            stage: {"epochs": 1, "batch_size": 32, "micro_batch_size": 32},
        }
    )


@pytest.mark.slow
def test_a_refused_upload_is_one_line_and_the_dpo_model_stays(
    sft_run, task_env, runtime, tmp_path, data_cfg, monkeypatch
):
    import huggingface_hub.constants

    out = tmp_path / "dpo"
    hub = {"push_to_hub": True, "hub_model_id": "me/tiny-dpo", "hub_token_env": "MY_HUB_TOKEN"}
    data = data_cfg(train=str(task_env.files.prefs_eval))
    cfg = _pref_cfg("dpo", out, sft_run, data, hub)
    monkeypatch.setenv("MY_HUB_TOKEN", TOKEN)
    with StubServer(_refusing_hub, max_requests=32) as stub:
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", stub.url)
        with pytest.raises(UserError) as caught:
            train_dpo(cfg, runtime)
    message = str(caught.value)
    assert "\n" not in message and TOKEN not in message
    assert message.startswith(f"run.push_to_hub: uploading {out / 'final'} to me/tiny-dpo failed")
    assert any("/commit/" in p for p, _, _ in stub.requests)  # it did try
    assert (out / "final" / "model.safetensors").is_file() and (out / "summary.json").is_file()
    meta, text = card(out / "final")
    assert meta["tags"] == ["rlhf_dist", "dpo"]
    assert f"| `train_loss` | {_summary(out)['train_loss']:.4g} |" in text


def test_kto_export_carries_a_card(sft_run, task_env, runtime, tmp_path, data_cfg):
    out = tmp_path / "kto"
    train_kto(
        _pref_cfg("kto", out, sft_run, data_cfg(train=str(task_env.files.prefs_eval))), runtime
    )
    meta, text = card(out / "final")
    assert meta["tags"] == ["rlhf_dist", "kto"]
    assert "with KTO." in text and "| `kto.beta` | 0.1 |" in text
    assert f"| `train_loss` | {_summary(out)['train_loss']:.4g} |" in text
