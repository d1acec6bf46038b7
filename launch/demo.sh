#!/usr/bin/env bash
# The offline demo: set up .venv if needed, then SFT -> reward model -> PPO -> eval
# on a generated task with tiny models. Usage: bash launch/demo.sh [OUTPUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
. .venv/bin/activate
rlhf-dist demo --output-dir "${1:-runs/demo}"
