"""The demo keeps its own settings: every stage config of every `rlhf-dist demo` variant,
effective after the package's defaults are filled in, equals the stored snapshot
(tests/data/demo_configs.json). A change of a package default that would change what the
demo runs, and so its published figures, fails here; the demo then sets the old value
itself. Regenerate the snapshot only for a deliberate change of the demo:
`python tests/unit/test_unit_demo_configs.py` (the dump at the end of this file)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rlhf_dist.config import config_from_dict, to_dict
from rlhf_dist.demo import arithmetic_demo, pipeline, tool_demo
from rlhf_dist.demo.iterative import iterate_tree
from rlhf_dist.demo.task import TaskFiles
from rlhf_dist.names import DEMO_OFFLINE, DEMO_RL_ALGORITHMS, ESTIMATORS

SNAPSHOT = Path(__file__).resolve().parents[1] / "data" / "demo_configs.json"


def effective_configs(root: Path) -> dict:
    """name -> the effective config (a plain dict) of every demo stage, with `root` (where
    the demo would write) shown as /DEMO."""
    (root / "task").mkdir(parents=True, exist_ok=True)
    (root / "task" / "task.json").write_text(json.dumps({"beta": 10.0}))  # iterate reads it
    out = _configs(root)
    return json.loads(json.dumps(out).replace(str(root), "/DEMO"))


def _configs(ROOT: Path) -> dict:
    files = TaskFiles.at(ROOT / "task")
    models = {"policy": ROOT / "models" / "policy", "reward": ROOT / "models" / "reward"}
    out = {}
    for algorithm in DEMO_RL_ALGORITHMS:
        trees = pipeline.stage_configs(
            ROOT, files, models, seed=0, quick=False, algorithm=algorithm
        )
        for stage, tree in trees.items():
            out[f"{algorithm}/{stage}"] = to_dict(config_from_dict(tree))
    for algorithm in DEMO_OFFLINE:
        tree = pipeline.offline_stage_config(ROOT, files, 0, algorithm)
        out[f"offline/{algorithm}"] = to_dict(config_from_dict(tree))
    trees = pipeline.stage_configs(ROOT, files, models, seed=0, quick=False)
    out["iterative/iterate"] = to_dict(config_from_dict(iterate_tree(ROOT, trees, files, 0, False)))
    tool_files = {
        name: ROOT / "tool" / f"{name}.jsonl" for name in ("sft", "prompts", "eval_prompts")
    }
    for stage, tree in tool_demo.tool_stage_configs(ROOT, tool_files, ROOT / "p", 0, False).items():
        out[f"tool_use/{stage}"] = to_dict(config_from_dict(tree))
    arithmetic = arithmetic_demo.arithmetic_stage_configs(ROOT, ROOT / "p", 0, False)
    for stage, tree in arithmetic.items():
        out[f"arithmetic/{stage}"] = to_dict(config_from_dict(tree))
    return out


COMMON = {"run", "model", "data", "perf", "lora", "distributed"}


def sections_read(name: str) -> set[str]:
    """The config sections the stage `name` ("<variant>/<stage>") reads: another stage's
    section (an RL run's sft.*) may change with the defaults without changing the demo."""
    variant, stage = name.split("/")
    if variant == "offline":  # simpo and orpo run the dpo stage
        stage = pipeline.OFFLINE_STAGES[stage]
    if stage in ("sft", "rm", "dpo", "kto"):
        return COMMON | {stage}
    if stage == "eval":
        return COMMON | {"generation", "reward", "eval"}
    if stage == "iterate":
        return COMMON | {"generation", "reward", "rm", "ppo", "eval", "iterate", "alerts", "debug"}
    return COMMON | {"generation", "reward", "ppo", "alerts", "debug"}  # an RL stage


def test_the_demo_runs_what_it_ran_whatever_the_package_defaults(tmp_path):
    want = json.loads(SNAPSHOT.read_text(encoding="utf-8"))
    got = effective_configs(tmp_path)
    assert got.keys() == want.keys()
    for name in want:
        read = sections_read(name)
        a = {k: v for k, v in want[name].items() if k in read}
        b = {k: v for k, v in got[name].items() if k in read}
        if not ESTIMATORS[want[name]["ppo"]["estimator"]].needs_critic:  # no critic's optimizer
            a["ppo"], b["ppo"] = (
                {k: v for k, v in x.get("ppo", {}).items() if k != "critic_optim"} for x in (a, b)
            )
        changed = _diff(a, b)
        assert not changed, f"{name}: {changed}"


def _diff(a: dict, b: dict, prefix: str = "") -> list[str]:
    """Dotted keys of the snapshot `a` whose values differ in `b` (a key added since is
    new and defaults to what the demo ran without it; a key gone is a difference)."""
    out = []
    for key in sorted(a):
        x, y = a.get(key), b.get(key)
        if isinstance(x, dict) and isinstance(y, dict):
            out += _diff(x, y, f"{prefix}{key}.")
        elif x != y:
            out.append(f"{prefix}{key}: {x!r} -> {y!r}")
    return out


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        configs = effective_configs(Path(tmp))
    SNAPSHOT.write_text(json.dumps(configs, indent=1, sort_keys=True) + "\n")
    print(f"wrote {SNAPSHOT}", file=sys.stderr)
