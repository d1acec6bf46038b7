"""Print the table of launch/bench/zero3.sh from its per-rank JSON rows."""

import json
import sys
from pathlib import Path

rows = [json.loads(p.read_text()) for p in sorted(Path(sys.argv[1]).glob("stage*_rank*.json"))]
mib = 1 / 2**20
print(
    f"model: {rows[0]['params'] / 1e6:.2f}M params ({rows[0]['dtype']}), {rows[0]['world_size']} ranks, {rows[0]['threads']} thread(s) each"
)
print(
    "stage rank  params MiB  grads MiB  optim+buffers MiB  total MiB | generate s  unsharded s  ratio  per-layer-gather s"
)
base = {}
for r in sorted(rows, key=lambda r: (r["zero_stage"], r["rank"])):
    m = r["model_state_bytes"]
    ratio = r["generate_s"] / r["generate_unsharded_s"]
    per_layer = r["generate_per_layer_gather_s"]
    print(
        f"{r['zero_stage']:>5} {r['rank']:>4} {m['params'] * mib:>11.2f} {m['grads'] * mib:>10.2f} "
        f"{m['optimizer_and_buffers'] * mib:>18.2f} {m['total'] * mib:>10.2f} | {r['generate_s']:>10.3f} "
        f"{r['generate_unsharded_s']:>12.3f} {ratio:>6.2f} {per_layer if per_layer is None else round(per_layer, 3)!s:>19}"
    )
    base.setdefault(r["zero_stage"], []).append(m["total"])
if 0 in base and 3 in base:
    share = max(base[3]) / max(base[0])
    print(f"ZeRO-3 per-rank model states = {share:.2f} x stage 0 (ideal with 2 ranks: 0.50)")
