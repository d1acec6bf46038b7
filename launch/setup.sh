#!/usr/bin/env bash
# Create (or reuse) .venv and install rlhf_dist with its test tools.
# Without a GPU, torch comes from the CPU wheel (torch==2.13.0), never a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    python -m pip install --quiet torch
  else
    python -m pip install --quiet torch==2.13.0
  fi
fi
python -m pip install --quiet -e ".[dev]"
