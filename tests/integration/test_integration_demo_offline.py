"""`rlhf-dist demo --algorithm dpo`: SFT -> DPO -> eval, with no reward model."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rlhf_dist.demo.pipeline import run_demo


@pytest.mark.slow
def test_offline_demo_writes_sft_and_algorithm_figures(tmp_path, runtime):
    threads = torch.get_num_threads()  # run_demo sets its own; restore the session's
    try:
        returned = run_demo(str(tmp_path), seed=0, quick=True, algorithm="dpo")
    finally:
        torch.set_num_threads(threads)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary == returned and summary["algorithm"] == "dpo"
    for section in ("sft", "dpo"):
        for key in ("gold_reward", "kl_to_ref", "length", "eos_rate"):
            assert math.isfinite(summary[section][key]), (section, key)
    assert summary["sft"]["kl_to_ref"] == 0.0  # the SFT policy is its own reference
    assert summary["dpo"]["kl_to_ref"] > 0
    assert not (tmp_path / "rm").exists(), "DPO needs no reward model"
    assert (tmp_path / "dpo" / "final" / "model.safetensors").is_file()
