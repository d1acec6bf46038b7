#!/usr/bin/env bash
# SimPO and ORPO, rlhf_dist's losses against TRL 1.16.0's (CPOTrainer with loss_type="simpo"
# and cpo_alpha=0, ORPOTrainer) on the same 16 held-out demo pairs and the same tiny SFT
# Llama in fp32: the loss and every logged metric of our trainer step (4 micro-batches)
# and held-out evaluation against TRL's one batch, TRL's per-pair loss function on our
# per-pair log-probs, the per-pair mean log-probs of each side's forward, and the gradient.
# A check, not a test: nothing here is run by launch/test.sh or CI (TRL is not a dependency).
#
# Usage: bash launch/bench/vs_trl_preference.sh
# Output: the side-by-side table and the largest absolute difference (exit 1 above 1e-4);
# raw numbers in runs/bench/vs_trl_preference/ (ours.json, trl.json, report.txt).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/bench/vs_trl_preference}

# PYTHON / TRL_PYTHON: other interpreters, as in vs_trl_grpo.sh.
PY=${PYTHON:-.venv/bin/python}
TRL_PY=${TRL_PYTHON:-.venv-trl-grpo/bin/python}
[ -n "${PYTHON:-}" ] || [ -x .venv/bin/python ] || bash launch/setup.sh

# TRL in its own venv, made exactly as vs_trl_grpo.sh makes it (and shared with it).
pin() { grep -oP "^$1==\K.*" launch/constraints.txt; }
if [ -z "${TRL_PYTHON:-}" ] && ! "$TRL_PY" -c "import trl" 2>/dev/null; then
  python3 -m venv .venv-trl-grpo
  .venv-trl-grpo/bin/pip install --quiet "torch==$(pin torch)"
  .venv-trl-grpo/bin/pip install --quiet trl==1.16.0 "transformers==$(pin transformers)" \
    "accelerate==$(pin accelerate)" "datasets==$(pin datasets)"
fi

export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # this checkout's rlhf_dist, whatever PY has
rm -rf "$OUT"
mkdir -p "$OUT"
"$PY" launch/bench/vs_trl_preference_ours.py prepare "$OUT" > "$OUT/ours.log" 2>&1 \
  || { tail -20 "$OUT/ours.log"; exit 1; }
"$TRL_PY" launch/bench/vs_trl_preference_trl.py "$OUT" > "$OUT/trl.log" 2>&1 \
  || { tail -20 "$OUT/trl.log"; exit 1; }
"$PY" launch/bench/vs_trl_preference_ours.py compare "$OUT" 2>&1 | tee "$OUT/report.txt"
exit "${PIPESTATUS[0]}"
