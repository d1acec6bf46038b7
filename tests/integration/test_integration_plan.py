"""The memory plan at the start of a run (api.run -> planning/start.py): its one line,
and run.auto_fit's derived config recorded in config.yaml (on CPU the budget is the
host's memory, so the whole per-rank share fits)."""

import yaml


def test_a_run_prints_its_plan_and_auto_fit_takes_the_largest_micro_batch(
    task_env, tmp_path, capsys
):
    from rlhf_dist import api
    from rlhf_dist.config import config_from_dict

    rows = task_env.files.sft.read_text().splitlines()[:16]  # one step: the plan is the point
    train = tmp_path / "sft.jsonl"
    train.write_text("\n".join(rows) + "\n")
    out = tmp_path / "run"

    cfg = config_from_dict({
        "run": {"output_dir": str(out), "auto_fit": True, "progress": False},
        "model": {"policy": str(task_env.policy)},
        "data": {"max_prompt_length": 16, "max_length": 48, "train": str(train)},
        "sft": {"epochs": 1, "batch_size": 16, "micro_batch_size": 1},
    })  # fmt: skip
    api.run("sft", cfg)
    printed = capsys.readouterr().out
    assert "sft: run.auto_fit: sft.micro_batch_size=16" in printed
    assert "sft: memory plan per rank: update " in printed
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["sft"]["micro_batch_size"] == 16 and saved["run"]["auto_fit"] is True
    assert cfg.sft.micro_batch_size == 1  # the given config is frozen and left alone
