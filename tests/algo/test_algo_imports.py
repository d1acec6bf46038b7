"""rlhf_dist.algo must stay pure tensor math (docs/architecture.md section 3): torch only.

Checked in a fresh interpreter, because inside pytest other tests (or plugins) may already
have imported the heavy packages, which would hide an accidental import.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
# Every module of the package, found on disk: a new one cannot slip past the check.
SUBMODULES = sorted(p.stem for p in (REPO_ROOT / "rlhf_dist" / "algo").glob("*.py"))
SUBMODULES.remove("__init__")
FORBIDDEN = ["transformers", "accelerate", "deepspeed", "peft", "datasets"]

_PROBE = f"""
import importlib, json, sys
import rlhf_dist.algo
for name in {SUBMODULES!r}:
    importlib.import_module("rlhf_dist.algo." + name)
loaded = sorted({{m.split(".")[0] for m in sys.modules}} & set({FORBIDDEN!r}))
print(json.dumps(loaded))
"""


def test_importing_algo_pulls_in_no_heavy_packages():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert loaded == [], f"importing rlhf_dist.algo loaded {loaded}"
