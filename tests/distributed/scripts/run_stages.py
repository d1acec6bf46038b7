"""Run several stages one after another in ONE process of a multi-rank launch, sharing
its process group: each command is validated and run as `rlhf-dist STAGE ARGS` would
(config, validation, input files, then `api.run_validated`), without the command line's
closing of the group after each stage (`api.close` runs once, at the end).

    accelerate launch ... run_stages.py '[["sft", "model.policy=...", ...], ["rm", ...]]'

A command may end in `--resume PATH`. Each stage is seeded afresh, as a process of its own
is. For launches that compare several stages: a launch costs ~10 s of imports per rank,
a tiny model's stage a few seconds."""

from __future__ import annotations

import json
import os
import sys

from rlhf_dist import api
from rlhf_dist.config import load_config, validate
from rlhf_dist.config.paths import check_stage_inputs
from rlhf_dist.config.presets import stage_and_preset


def run(argv: list[str]) -> None:
    name, overrides = argv[0], argv[1:]
    if "--resume" in overrides:
        at = overrides.index("--resume")
        overrides = [*overrides[:at], f"run.resume={overrides[at + 1]}", *overrides[at + 2 :]]
    stage, preset = stage_and_preset(name, None)
    cfg = load_config(None, overrides, preset)
    validate(cfg, stage, int(os.environ.get("WORLD_SIZE", "1")))
    check_stage_inputs(cfg, stage)
    api.run_validated(stage, cfg)


if __name__ == "__main__":
    for command in json.loads(sys.argv[1]):
        run(command)
    sys.exit(api.end_process(0))  # closes the group once; gloo and interpreter exit
