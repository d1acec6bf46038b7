#!/usr/bin/env bash
# Create (or reuse) .venv and install rlhf_dist with its test tools.
# Without a GPU, torch comes from the CPU wheel (torch==2.13.0), never a multi-GB CUDA build.
# Every install is held to launch/constraints.txt: the exact versions the tests ran with.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PINS=launch/constraints.txt
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install --quiet -c "$PINS" --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    python -m pip install --quiet -c "$PINS" torch
  else
    python -m pip install --quiet -c "$PINS" torch==2.13.0
  fi
fi
python -m pip install --quiet -c "$PINS" -e ".[dev]"
# DeepSpeed JIT-compiles its CPU shared-memory collective op the first time a CPU process
# group starts (about a minute, cached under ~/.cache/torch_extensions). Build it here, once,
# so the first 2-rank run or test does not pay for it inside its time limit.
if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  python - <<'PY' 2>/dev/null || echo "setup: could not prebuild DeepSpeed's CPU comm op (it builds on first use)"
from deepspeed.accelerator import get_accelerator
get_accelerator().create_op_builder("ShareMemCommBuilder").load(verbose=False)
PY
fi
