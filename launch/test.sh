#!/usr/bin/env bash
# The test command: set up .venv if needed, lint, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
. .venv/bin/activate
ruff check .
ruff format --check .
python -m pytest -q "$@"
