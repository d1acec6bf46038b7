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
# Two workers (pytest-xdist) on the 2-core CI machine; the 2-rank tests run one at a time
# in their own group (tests/distributed/conftest.py). RLHF_DIST_TEST_WORKERS=0 runs
# everything in one process.
WORKERS=${RLHF_DIST_TEST_WORKERS:-2}
if [ "$WORKERS" = 0 ]; then
  python -m pytest -q "$@"
else
  python -m pytest -q -n "$WORKERS" --dist loadgroup "$@"
fi
