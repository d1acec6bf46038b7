"""Every input in tests/bad_inputs/corpus ends as stated: a counted, reported skip, or one
clear error line (exit 2, no traceback) and no half-written output directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CORPUS = Path(__file__).parent / "corpus"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from chat_tokenizers import build_chat_tokenizer

    from rlhf_dist.demo import task
    from rlhf_dist.models import quiet_transformers

    quiet_transformers()
    root = tmp_path_factory.mktemp("bad_inputs")
    tok = task.build_tokenizer(root / "tok")
    models = task.build_tiny_models(root / "models", tok)
    # The same tokenizer with its PAD token removed: a common hub tokenizer mistake.
    no_pad = root / "no_pad"
    tok.pad_token = None
    tok.save_pretrained(no_pad)
    chat_tok = build_chat_tokenizer(root / "chat_tok", "chatml")
    chat = task.build_tiny_models(root / "chat_models", chat_tok)
    return {
        "policy": str(models["policy"]),
        "reward": str(models["reward"]),
        "no_pad": str(no_pad),
        "chat_policy": str(chat["policy"]),
    }


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m rlhf_dist ARGS` as a user runs it, with `env` added to the environment."""
    path = {"PYTHONPATH": f"{REPO}{os.pathsep}{CORPUS}", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "rlhf_dist", *args]
    return subprocess.run(
        cmd, cwd=REPO, env={**os.environ, **path, **(env or {})}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


def assert_one_line_error(proc, *words: str) -> None:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("rlhf-dist")]
    assert len(lines) == 1, proc.stderr[-3000:]
    for word in words:
        assert word in lines[0], lines[0]


def sft(
    tiny, data: str, out: Path, *extra: str, env: dict | None = None
) -> subprocess.CompletedProcess:
    base = [
        f"model.policy={tiny['policy']}",
        f"data.train={CORPUS / data}",
        f"run.output_dir={out}",
    ]
    return run(
        "sft", *base, "sft.batch_size=8", "sft.micro_batch_size=8", "data.max_length=48",
        "data.max_prompt_length=64", *extra,  # the lengths the corpus's long rows exceed
        env=env,
    )  # fmt: skip


@pytest.fixture(scope="module")
def pickled(tiny, tmp_path_factory):
    """The tiny policy saved only as pickle (pytorch_model.bin), with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf_dist.demo.task import build_tokenizer

    pickled = tmp_path_factory.mktemp("pickled")
    AutoModelForCausalLM.from_pretrained(tiny["policy"]).save_pretrained(pickled)
    state = AutoModelForCausalLM.from_pretrained(pickled).state_dict()
    (pickled / "model.safetensors").unlink()
    torch.save(state, pickled / "pytorch_model.bin")  # the legacy pickle format
    build_tokenizer(pickled)
    return str(pickled)


SECRET = "wandb-secret-0123456789"


@pytest.fixture(scope="module")
def mixed_rows_run(tiny, pickled, tmp_path_factory):
    """ONE successful SFT launch on sft_mixed_bad_rows.jsonl (each launch is ~10 s of
    imports) that four tests read, each for its own input: its bad rows (dropped when too
    long), a tokenizer without a PAD token, secrets in the environment, and a policy saved
    only as pickle with model.safetensors_only=false. -> (process, output directory)."""
    out = tmp_path_factory.mktemp("mixed_rows") / "out"
    proc = sft(
        {**tiny, "policy": pickled}, "sft_mixed_bad_rows.jsonl", out, "data.too_long=drop",
        f"model.tokenizer={tiny['no_pad']}", "model.safetensors_only=false",
        env={"WANDB_API_KEY": SECRET, "HF_TOKEN": SECRET},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, out


def test_bad_sft_rows_are_skipped_counted_and_reported(mixed_rows_run):
    proc, _ = mixed_rows_run
    report = next(line for line in proc.stdout.splitlines() if line.startswith("sft data"))
    # 40 good rows kept; each bad row counted under its reason.
    assert "40 kept" in report and "6 skipped" in report, report
    for reason in (
        "missing 'prompt'",
        "empty 'prompt'",
        "'prompt' not text",
        "missing 'response'",
        "prompt too long",
    ):
        assert reason in report, report


def test_bad_conversations_are_skipped_counted_and_reported(tiny, tmp_path):
    proc = sft({**tiny, "policy": tiny["chat_policy"]}, "sft_chat_bad_rows.jsonl", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = next(line for line in proc.stdout.splitlines() if line.startswith("sft data"))
    assert "40 kept" in report and "4 skipped" in report, report
    for reason in (
        "unknown role in 'messages'",
        "empty content in 'messages'",
        "no assistant turn in 'messages'",
        "longer than data.max_length",
    ):
        assert reason in report, report


def test_bad_kto_conversations_are_skipped_counted_and_reported(tiny, tmp_path):
    args = [
        f"model.policy={tiny['chat_policy']}",
        f"data.train={CORPUS / 'kto_chat_bad_rows.jsonl'}",
    ]
    out = [f"run.output_dir={tmp_path / 'out'}", "kto.batch_size=8", "kto.micro_batch_size=8"]
    proc = run("kto", *args, *out, "data.max_length=48")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = next(line for line in proc.stdout.splitlines() if line.startswith("kto examples"))
    assert "40 kept" in report and "5 skipped" in report, report
    assert "(20 desirable, 20 undesirable)" in report, report
    for reason in (
        "'label' not true/false",
        "'completion' holds turns other than the assistant's",
        "last turn of 'prompt' not from the user",
        "unknown role in 'completion'",
        "empty content in 'completion'",
    ):
        assert reason in report, report


def test_conversations_without_a_chat_template_are_one_line(tiny, tmp_path):
    out = tmp_path / "out"
    proc = sft(tiny, "sft_chat_bad_rows.jsonl", out)  # the word-level tokenizer has no template
    assert_one_line_error(proc, "data.train", "sft_chat_bad_rows.jsonl", "data.chat_template")
    assert not out.exists()


def test_bad_preference_rows_are_skipped_counted_and_reported(tiny, tmp_path):
    args = [f"model.policy={tiny['policy']}", f"data.train={CORPUS / 'prefs_mixed_bad_rows.jsonl'}"]
    proc = run(
        "rm",
        *args,
        f"run.output_dir={tmp_path / 'out'}",
        "rm.batch_size=8",
        "rm.micro_batch_size=8",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = next(line for line in proc.stdout.splitlines() if line.startswith("preference pairs"))
    assert (
        "40 kept" in report and "chosen == rejected" in report and "missing 'rejected'" in report
    ), report
    assert "'chosen' not text" in report, report


def test_long_prompts_are_truncated_and_counted_by_default(tiny, tmp_path):
    args = [f"model.policy={tiny['policy']}", "reward.function=reward_fns:nan_score"]
    out = tmp_path / "never"
    proc = run(
        "ppo",
        *args,
        f"data.train={CORPUS / 'prompts_too_long.jsonl'}",
        "data.max_prompt_length=64",  # the corpus's prompts are longer than 64 tokens
        f"run.output_dir={out}",
        "reward.function=rlhf_dist.demo.task:positive_word_reward",
        "ppo.critic_init=policy",
        "ppo.iterations=1",
        "ppo.rollout_batch_size=16",
        "generation.max_new_tokens=4",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "16 prompts truncated to their last tokens" in proc.stdout


@pytest.mark.parametrize(
    ("data", "extra", "words"),
    [
        ("sft_all_bad.jsonl", (), ("sft.batch_size", "0 usable", "5 missing 'prompt'")),
        ("invalid_utf8.jsonl", (), ("data.train", "cannot load")),
        ("missing.jsonl", (), ("data.train", "does not exist")),
        ("empty.jsonl", (), ("data.train", "empty.jsonl", "is empty")),
        ("blank_lines.jsonl", (), ("data.train", "blank_lines.jsonl", "is empty")),
        (
            "sft_mixed_bad_rows.jsonl",
            ("model.policy=/nonexistent/model",),
            ("model.policy", "does not exist"),
        ),
    ],
)
def test_unusable_sft_input_is_one_line_and_writes_nothing(tiny, tmp_path, data, extra, words):
    out = tmp_path / "out"
    proc = sft(tiny, data, out, *extra)
    assert_one_line_error(proc, *words)
    assert not out.exists(), "a failed start left an output directory behind"


def test_tokenizer_without_pad_token_trains_and_is_exported_as_shipped(mixed_rows_run):
    # Llama-3 and Mistral instruct tokenizers ship no PAD: the run pads with EOS, says so
    # once, and exports the tokenizer without a PAD again (docs/data.md, padding).
    from transformers import AutoTokenizer

    proc, out = mixed_rows_run
    assert proc.stdout.count("has no PAD token; padding with EOS") == 1, proc.stdout
    exported = AutoTokenizer.from_pretrained(out / "final")
    assert exported.pad_token is None and exported.eos_token == "<eos>"


@pytest.mark.parametrize("config", ["not_a_mapping.yaml", "bad_yaml.yaml"])
def test_broken_config_files_are_one_line(tmp_path, config):
    assert_one_line_error(run("sft", "--config", str(CORPUS / config)), "--config")


@pytest.mark.parametrize(
    ("fn", "words"),
    [
        ("raises", ("raised ValueError", "my scorer crashed")),
        ("wrong_length", ("returned 1 scores for 16",)),
        ("nan_score", ("non-finite",)),
        ("text_score", ("non-number",)),
        ("no_such_function", ("reward.function", "cannot import")),
    ],
)
def test_bad_reward_functions_are_one_line(tiny, tmp_path, fn, words):
    args = [
        f"model.policy={tiny['policy']}",
        f"data.train={CORPUS / 'prompts_ok.jsonl'}",
        f"reward.function=reward_fns:{fn}",
    ]
    out = tmp_path / "out"
    proc = run(
        "ppo",
        *args,
        f"run.output_dir={out}",
        "ppo.critic_init=policy",
        "ppo.iterations=1",
        "ppo.rollout_batch_size=16",
        "generation.max_new_tokens=4",
        "reward.retry_delay_s=0",
    )
    assert_one_line_error(proc, *words)
    assert not out.exists(), "a reward failure before any iteration left a run directory"


def test_secrets_never_reach_the_written_config(mixed_rows_run):
    _, out = mixed_rows_run  # run with WANDB_API_KEY and HF_TOKEN set to SECRET
    for path in out.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path
    assert json.loads((out / "summary.json").read_text())["steps"] > 0


def test_pickle_checkpoints_are_refused_unless_allowed(tiny, pickled, mixed_rows_run, tmp_path):
    """A model saved only as pickle (.bin) can run code when loaded: refused by default;
    with model.safetensors_only=false it trains (the shared run's policy is this one)."""
    out = tmp_path / "out"
    proc = sft({**tiny, "policy": pickled}, "sft_mixed_bad_rows.jsonl", out)
    assert_one_line_error(proc, "model.policy", "cannot load")
    assert not out.exists()
    allowed, _ = mixed_rows_run
    assert (
        "model.safetensors_only=false" in allowed.args and f"model.policy={pickled}" in allowed.args
    )
