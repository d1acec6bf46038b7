"""Session fixtures of the integration tests: one runtime, one tiny task, one SFT and RM run.

Everything heavy is built once per session and shared read-only: the demo task files, the
word-level tokenizer, the random-init tiny Llama policy/reward model, a short SFT run and a
short reward-model run on top of it. Tests that need a fresh output directory use
`tmp_path`; no test may write into a session directory (test_integration_ppo checks that
the trainers leave their inputs alone).

Helpers are fixtures, not an importable module, for the reason tests/algo/conftest.py gives:
the test directories have no __init__.py, so fixtures are the one import-free way to share.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from rlhf_dist.models import quiet_transformers

quiet_transformers()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: takes tens of seconds on a 2-core CPU (deselect with -m 'not slow')"
    )


# Sequence limits of the demo (demo/pipeline.py): demo prompts are <= 8 words and responses
# <= 20 words + EOS, so nothing is dropped or truncated.
DATA = {"max_prompt_length": 16, "max_length": 48}


@dataclass(frozen=True)
class TaskEnv:
    files: object  # rlhf_dist.demo.task.TaskFiles
    tokenizer: object
    policy: Path  # random-init LlamaForCausalLM (+ tokenizer)
    reward: Path  # random-init LlamaForSequenceClassification, num_labels=1 (+ tokenizer)
    prompts: Path  # a user prompt file written by hand (not by write_task)


@dataclass(frozen=True)
class StageRun:
    out: Path
    cfg: object
    summary: dict
    trained: object = None  # the in-memory trained model, where a test needs it


@pytest.fixture(scope="session")
def runtime():
    """The ONE runtime of the session: accelerate's state is a process-wide singleton."""
    from rlhf_dist.distributed import Runtime

    return Runtime(seed=0, num_threads=1)


@pytest.fixture(scope="session")
def task_env(tmp_path_factory) -> TaskEnv:
    from rlhf_dist.demo import task

    root = tmp_path_factory.mktemp("task")
    # Counts are the smallest that still let SFT produce well-formed reviews and the reward
    # model learn the sentiment preference within a couple of seconds each.
    files = task.write_task(
        root / "data",
        seed=0,
        n_sft=1024,
        n_pref=512,
        n_pref_eval=200,
        n_prompts=64,
        n_eval_prompts=32,
    )
    tokenizer = task.build_tokenizer(files.tokenizer_dir)
    models = task.build_tiny_models(root / "models", tokenizer, size="tiny", seed=0)
    # A prompt file as a user would write it: only a "prompt" field, drawn from the demo's
    # vocabulary (make_prompt), so the rows are not the ones write_task produced.
    rng = random.Random(1234)
    prompts = root / "user_prompts.jsonl"
    with prompts.open("w", encoding="utf-8") as f:
        for _ in range(48):
            f.write(json.dumps({"prompt": task.make_prompt(rng)[0]}) + "\n")
    return TaskEnv(files, tokenizer, models["policy"], models["reward"], prompts)


@pytest.fixture(scope="session")
def sft_run(task_env, runtime, tmp_path_factory) -> StageRun:
    """A short SFT of the random policy: 3 epochs x 32 steps of 32 reviews (~2 s)."""
    from rlhf_dist.config import config_from_dict
    from rlhf_dist.trainers.sft import train_sft

    out = tmp_path_factory.mktemp("sft")
    cfg = config_from_dict(
        {
            "run": {"output_dir": str(out), "seed": 0, "log_every": 8},
            "model": {"policy": str(task_env.policy)},
            "data": {**DATA, "train": str(task_env.files.sft)},
            "sft": {
                "epochs": 3,
                "batch_size": 32,
                "micro_batch_size": 32,
                "optim": {"lr": 3e-3, "schedule": "cosine", "warmup_steps": 5},
            },
        }
    )
    return StageRun(out, cfg, train_sft(cfg, runtime))


@pytest.fixture(scope="session")
def rm_run(task_env, sft_run, runtime, tmp_path_factory) -> StageRun:
    """A short reward-model run from the SFT policy (2 epochs of 512 pairs, ~2 s).

    `trained` is the classifier the trainer trained, caught when it is loaded (training
    updates it in place), so tests can compare it with the export.
    """
    from rlhf_dist.config import config_from_dict
    from rlhf_dist.distributed import seed_everything
    from rlhf_dist.trainers import reward

    out = tmp_path_factory.mktemp("rm")
    cfg = config_from_dict(
        {
            "run": {"output_dir": str(out), "seed": 0, "log_every": 8},
            "model": {"policy": str(sft_run.out / "final")},
            "data": {
                **DATA,
                "train": str(task_env.files.prefs_train),
                "eval": str(task_env.files.prefs_eval),
            },
            "rm": {
                "epochs": 2,
                "batch_size": 32,
                "micro_batch_size": 32,
                "optim": {"lr": 1e-3, "schedule": "cosine", "warmup_steps": 5},
            },
        }
    )
    loaded = []
    original = reward.load_sequence_classifier

    def capture(*args, **kwargs):
        loaded.append(original(*args, **kwargs))
        return loaded[-1]

    # The new score head is drawn from the global RNG, which earlier tests have advanced
    # by a varying amount: seed it so the run does not depend on test order.
    seed_everything(0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(reward, "load_sequence_classifier", capture)
        summary = reward.train_reward_model(cfg, runtime)
    assert len(loaded) == 1, "expected exactly one classifier load in train_reward_model"
    return StageRun(out, cfg, summary, trained=loaded[0])


# ------------------------------------------------------------------------------- helpers


def _read_jsonl(path: Path) -> list[dict]:
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _state_dict(path: Path, kind: str = "causal") -> dict[str, torch.Tensor]:
    """The weights saved under `path`, loaded the way users load them: kind "causal" with
    AutoModelForCausalLM, anything else with AutoModelForSequenceClassification."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    if kind == "causal":
        model = AutoModelForCausalLM.from_pretrained(path)
    else:
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _dir_digest(path: Path) -> dict[str, str]:
    """sha256 of every file under `path`: proof a directory was not modified."""
    root = Path(path)
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _changed(before: dict, after: dict) -> list[str]:
    """Names whose tensors differ (same key sets required)."""
    assert before.keys() == after.keys()
    return [k for k in before if not torch.equal(before[k], after[k].to(before[k].dtype))]


@pytest.fixture(scope="session")
def read_jsonl():
    return _read_jsonl


@pytest.fixture(scope="session")
def saved_state_dict():
    return _state_dict


@pytest.fixture(scope="session")
def dir_digest():
    return _dir_digest


@pytest.fixture(scope="session")
def changed_tensors():
    return _changed


@pytest.fixture(scope="session")
def data_cfg():
    """The data section every integration run uses (a fresh dict each time)."""
    return lambda **extra: {**DATA, **extra}
