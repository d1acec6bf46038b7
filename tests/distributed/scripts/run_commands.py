"""Run several `rlhf-dist` commands one after another in ONE process: each is the CLI's
own `main` on its arguments, as `python -m rlhf_dist ARGS` would run it; the first that
fails ends the process with its exit status.

    python run_commands.py '[["ppo", "model.policy=...", ...], ["sft", ...]]'

For reference runs that several tests compare with: a process launch costs ~10 s of
imports, a tiny model's run a few seconds."""

from __future__ import annotations

import json
import sys

from rlhf_dist.cli import main
from rlhf_dist.distributed.process_exit import end_process

if __name__ == "__main__":
    status = 0
    for argv in json.loads(sys.argv[1]):
        status = main(argv)
        if status:
            break
    sys.exit(end_process(status))  # gloo and interpreter exit: distributed/process_exit.py
