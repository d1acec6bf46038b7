"""`rlhf-dist demo --task vision` (rlhf_dist/demo/vision_demo.py) in its --quick form: the
tiny Qwen2-VL is built, evaluated, trained by SFT then GRPO, evaluated after each, and the
summary written; SFT and GRPO each change the weights. Another --algorithm is refused."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from rlhf_dist.cli import main
from rlhf_dist.demo.vision_demo import run_vision_demo


def test_the_quick_vision_demo_trains_and_reports_held_out_accuracy(tmp_path):
    summary = run_vision_demo(str(tmp_path), quick=True)
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert summary["held_out_rows"] == 16
    for stage in ("base", "sft", "grpo"):
        assert 0.0 <= summary[f"accuracy_{stage}"] <= 1.0
    base, sft, grpo = (
        load_file(str(d / "model.safetensors"))
        for d in (tmp_path / "base", tmp_path / "sft" / "final", tmp_path / "grpo" / "final")
    )
    tower = [k for k in base if ".visual." in f".{k}"]
    assert tower  # trained too: model.freeze_vision is off in the demo
    assert any(not torch.equal(base[k], sft[k]) for k in tower)
    assert any(not torch.equal(sft[k], grpo[k]) for k in sft)


def test_the_vision_demo_runs_grpo_only(tmp_path, capsys):
    argv = ["demo", "--task", "vision", "--algorithm", "dpo", "--output-dir", str(tmp_path)]
    assert main(argv) == 2
    assert "--task vision: runs with --algorithm grpo only" in capsys.readouterr().err
    assert not (tmp_path / "base").exists()
