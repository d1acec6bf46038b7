"""The torch-free names (rlhf_dist/names.py, rlhf_dist/errors.py) and what they are for:
`rlhf-dist --help` and config errors return without importing torch
(docs/architecture.md section 2)."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_dist import names
from rlhf_dist.algo import catalog
from rlhf_dist.algo.estimators import ESTIMATORS
from rlhf_dist.algo.kl import KL_KINDS
from rlhf_dist.algo.losses import LOSS_AGGREGATIONS
from rlhf_dist.algo.policy_losses import POLICY_LOSSES

ROOT = Path(__file__).resolve().parents[2]

# Runs cli.main in a fresh interpreter and prints its exit status and which heavy modules
# it imported; stdout/stderr of the CLI itself are swallowed.
PROBE = """
import contextlib, io, json, sys
from rlhf_dist import cli
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
    try:
        rc = cli.main(sys.argv[1:])
    except SystemExit as e:
        rc = e.code
heavy = [m for m in ("torch", "transformers", "accelerate", "deepspeed") if m in sys.modules]
print(json.dumps({"rc": rc, "heavy": heavy, "stderr": err.getvalue()}))
"""


def test_names_are_the_algo_registries_own():
    """names re-exports algo.catalog, from which the registries are built (no mirror)."""
    assert names.ESTIMATORS is catalog.ESTIMATORS  # ppo.estimator's choices
    assert tuple(names.ESTIMATORS) == (*ESTIMATORS, *catalog.OBJECTIVES)
    for name, entry in ESTIMATORS.items():
        assert entry.traits is names.ESTIMATORS[name], name
    assert tuple(POLICY_LOSSES) == names.POLICY_LOSSES


def test_dpo_loss_types_are_one_list():
    from rlhf_dist.algo import preference
    from rlhf_dist.config import DPOConfig

    choices = next(f for f in dataclasses.fields(DPOConfig) if f.name == "loss_type")
    assert choices.metadata["choices"] == names.DPO_LOSS_TYPES == preference.DPO_LOSS_TYPES
    assert set(names.REFERENCE_FREE_LOSSES) < set(names.DPO_LOSS_TYPES)


def test_kl_kinds_and_loss_aggregations_match_the_algo_registries():
    assert names.KL_KINDS == KL_KINDS
    assert names.LOSS_AGGREGATIONS == LOSS_AGGREGATIONS


def test_demo_algorithms_match_the_pipeline():
    from rlhf_dist.demo import pipeline

    assert tuple(pipeline.OBJECTIVE_PRESETS) == names.DEMO_OBJECTIVES
    assert pipeline.ALGORITHMS == names.DEMO_ALGORITHMS
    assert len(set(names.DEMO_ALGORITHMS)) == len(names.DEMO_ALGORITHMS)


def test_config_reexports_the_exceptions():
    from rlhf_dist import config, errors
    from rlhf_dist.distributed import TrainingDiverged
    from rlhf_dist.trainers.common import Preempted

    assert config.ConfigError is errors.ConfigError
    assert config.UserError is errors.UserError
    assert config.RewardFunctionError is errors.RewardFunctionError
    assert TrainingDiverged is errors.TrainingDiverged and Preempted is errors.Preempted


def run_cli(*argv: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "argv, rc, message",
    [
        (("--help",), 0, ""),
        (("sft", "--help"), 0, ""),
        (("demo", "--help"), 0, ""),
        (("config", "ppo"), 0, ""),
        (("sft", "sft.batch_size=0"), 2, "sft.batch_size"),
        (("ppo", "ppo.kl_kind=k9"), 2, "ppo.kl_kind"),
        (("sft", "nosuch.key=1"), 2, "nosuch"),
    ],
)
def test_help_and_config_errors_import_no_torch(argv, rc, message):
    result = run_cli(*argv)
    assert result["rc"] == rc, result
    assert message in result["stderr"]
    assert result["heavy"] == [], result


def test_the_probe_sees_torch():
    """The check above can fail: a stage that gets past validation loads torch."""
    result = run_cli("config", "ppo")
    assert result["heavy"] == []
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    code = "import sys, rlhf_dist.algo.losses; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.strip() == "True"
