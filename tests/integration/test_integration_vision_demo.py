"""`rlhf-dist demo --task vision` (rlhf_dist/demo/vision_demo.py) in its --quick form: the
tiny Qwen2-VL is built, evaluated, trained by SFT then GRPO, evaluated after each, and the
summary written and the results block printed; SFT and GRPO each change the weights, and the
KL estimate of a policy to itself is 0. Another --algorithm is refused."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from rlhf_dist.cli import main
from rlhf_dist.demo import vision_task
from rlhf_dist.demo.vision_demo import kl_to_sft, run_vision_demo


def test_the_quick_vision_demo_trains_and_reports_held_out_accuracy(tmp_path, capsys):
    summary = run_vision_demo(str(tmp_path), quick=True)
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert summary["held_out_rows"] == 16
    for stage in ("base", "sft", "grpo"):
        assert 0.0 <= summary[f"accuracy_{stage}"] <= 1.0
    out = capsys.readouterr().out
    assert "== demo results (16 held-out images" in out
    before, after = summary["accuracy_sft"], summary["accuracy_grpo"]
    assert f"SFT {before:.3f}  ->  GRPO {after:.3f} ({after - before:+.3f})" in out
    assert f"KL to SFT     GRPO {summary['kl_to_sft']:.2f} nats per response" in out
    sft_dir, rows = tmp_path / "sft" / "final", vision_task.held_out_rows(4)
    assert kl_to_sft(sft_dir, sft_dir, rows, 1.0, seed=0) == 0.0
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
