"""The memory planner (`rlhf-dist plan`, docs/distributed.md "Planning memory"): each
phase's per-rank peak from the models' config.json alone, torch-free. `memory` holds the
arithmetic, `plan` which terms a configuration has, `advice` what to change to fit and
the printed forms, `shapes` reads the architecture numbers."""

from rlhf_dist.planning.advice import (
    Fix,
    cli_plan,
    find_fix,
    format_plan,
    hardware,
    one_line,
    verdict,
    with_overrides,
)
from rlhf_dist.planning.memory import GIB, ModelShape
from rlhf_dist.planning.plan import Hardware, Phase, Plan, Shapes, build_plan
from rlhf_dist.planning.shapes import read_shapes

__all__ = [
    "GIB", "Fix", "Hardware", "cli_plan", "hardware", "ModelShape", "Phase", "Plan", "Shapes", "build_plan",
    "find_fix", "format_plan", "one_line", "read_shapes", "verdict", "with_overrides",
]  # fmt: skip
