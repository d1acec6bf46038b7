#!/usr/bin/env bash
# The test command: set up .venv if needed, lint, check the architecture contracts and
# types, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
. .venv/bin/activate
ruff check .
ruff format --check .
lint-imports                   # layers and forbidden imports: [tool.importlinter] in pyproject.toml
mypy                           # [tool.mypy] in pyproject.toml
# Two workers (pytest-xdist) on the 2-core CI machine, each given whole files (loadfile: a
# module-scoped fixture, e.g. one 2-rank launch that several tests read, is built once), the
# long files first (tests/conftest.py). Two 2-rank tests may run at once (4 ranks on 2 cores):
# alone, a 2-rank launch leaves the cores idle about half its time (process start,
# checkpoint writes, rank 0 alone), so pairing them is faster than queueing them.
# RLHF_DIST_TEST_WORKERS=0 runs everything in one process.
WORKERS=${RLHF_DIST_TEST_WORKERS:-2}
if [ "$WORKERS" = 0 ]; then
  python -m pytest -q "$@"
else
  python -m pytest -q -n "$WORKERS" --dist loadfile --no-loadscope-reorder "$@"
fi
