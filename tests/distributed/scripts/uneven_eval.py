"""Every stage that evaluates, in ONE 2-rank process group, on eval sets that split unevenly.

Usage: uneven_eval.py TIMEOUT_S STAGE[/TAG]=OVERRIDES_FILE...
Each STAGE (sft, rm, dpo, kto, eval, ppo) runs in turn on the same Runtime with the
`section.key=value` lines of its overrides file, exactly as `rlhf-dist STAGE` would after
parsing (load_config, validate, the stage's runner); a TAG tells apart two runs of one
stage. The Runtime's collectives time out after TIMEOUT_S (distributed.timeout_s), so a
rank left waiting for a forward pass that its peer never runs fails the launch in seconds
instead of hanging. After each run a line "UNEVEN-EVAL-OK STAGE[/TAG]" is printed; the
tests check the lines and the outputs.
"""

import importlib
import os
import sys
from pathlib import Path

from rlhf_dist.api import RUNNERS
from rlhf_dist.config import load_config, validate
from rlhf_dist.distributed import Runtime
from rlhf_dist.distributed.process_exit import end_process
from rlhf_dist.models import quiet_transformers


def main():
    timeout_s, stages = int(sys.argv[1]), sys.argv[2:]
    quiet_transformers()
    runtime = Runtime(seed=0, num_threads=1, timeout_s=timeout_s)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    for item in stages:
        name, _, path = item.partition("=")
        stage = name.partition("/")[0]
        overrides = Path(path).read_text(encoding="utf-8").split()
        cfg = load_config(None, overrides)
        validate(cfg, stage, world)
        module_name, _, fn_name = RUNNERS[stage].partition(":")
        getattr(importlib.import_module(module_name), fn_name)(cfg, runtime)
        runtime.print(f"UNEVEN-EVAL-OK {name}")
    runtime.close()


if __name__ == "__main__":
    main()
    sys.exit(end_process(0))  # gloo and interpreter exit: distributed/process_exit.py
