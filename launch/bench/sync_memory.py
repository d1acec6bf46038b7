"""Memory of the weight sync to a rollout server under ZeRO-3 (docs/serving.md, "Weight
sync memory"): the arithmetic demo's GRPO work (quick size, the real SmolLM2-135M in fp32,
513 MiB of weights) on 2 CPU ranks under ZeRO-3 (accelerate_configs/cpu_zero3.yaml, gloo),
its rollouts from one `rlhf-dist serve` process, with each bucket size of
generation.server_sync_bucket_mb. Prints, per bucket size, the largest bucket in MiB and
`memory/sync_peak_mib` (how far the sync raised a rank's resident memory; the largest
over ranks and iterations) and the sync's seconds: under ZeRO-3 each bucket is gathered
on its own, so the growth should follow the bucket, not the model.

Usage: python launch/bench/sync_memory.py [--buckets 16 64 1024] [--iterations 2]
       [--out runs/bench/sync_memory]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import TOKEN_ENV, start_server  # noqa: E402 (this folder's rollout-server benchmark)

from rlhf_dist.api import end_process
from rlhf_dist.demo import arithmetic_demo, smollm2  # noqa: E402
from rlhf_dist.distributed.weight_sync import free_port, weight_buckets  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def largest_bucket_mib(policy: Path, bucket_mb: float) -> float:
    """The largest bucket the walk makes of the policy's weights, in MiB (fp32)."""
    from safetensors import safe_open

    with safe_open(str(policy / "model.safetensors"), "pt") as f:
        named = [(k, f.get_slice(k)) for k in f.keys()]  # noqa: SIM118 (safe_open has no __iter__)
        sizes = [(k, _numel(s.get_shape())) for k, s in named]

    class Sized:  # weight_buckets reads numel() and element_size()
        def __init__(self, n):
            self.n = n

        def numel(self):
            return self.n

        def element_size(self):
            return 4

    buckets = weight_buckets(((k, Sized(n)) for k, n in sizes), int(bucket_mb * 2**20))
    return max(sum(p.n for _, p in b) for b in buckets) * 4 / 2**20


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def run(policy: Path, url: str, bucket_mb: float, out: Path, iterations: int) -> list[dict]:
    tree = arithmetic_demo.arithmetic_stage_configs(out, policy, seed=0, quick=True)["grpo"]
    tree["run"] |= {"output_dir": str(out / f"bucket{bucket_mb:g}"), "progress": False}
    tree["generation"] |= {"backend": "server", "server_urls": [url],
                           "server_token_env": TOKEN_ENV, "server_sync_bucket_mb": bucket_mb}  # fmt: skip
    tree["ppo"] |= {"iterations": iterations, "micro_batch_size": 8}  # 2 ranks x 8 = a minibatch
    tree["perf"] = {"num_threads": 1}
    config = out / f"bucket{bucket_mb:g}.json"
    config.write_text(json.dumps(tree))
    cmd = [sys.executable, "-m", "accelerate.commands.launch",
           "--config_file", str(REPO / "accelerate_configs" / "cpu_zero3.yaml"),
           "--main_process_port", str(free_port()),
           "-m", "rlhf_dist", "ppo", "--config", str(config)]  # fmt: skip
    subprocess.run(cmd, env=os.environ | {"OMP_NUM_THREADS": "1"}, check=True)
    lines = (out / f"bucket{bucket_mb:g}" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "memory/sync_peak_mib" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--buckets", type=float, nargs="+", default=[16, 64, 1024])
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--out", default="runs/bench/sync_memory")
    args = parser.parse_args()
    os.environ.setdefault(TOKEN_ENV, os.urandom(16).hex())
    policy, out = smollm2.build("shipped"), Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        server = start_server(policy, port, 1, Path(tmp))
        try:
            for mb in args.buckets:
                rows = run(policy, f"http://127.0.0.1:{port}", mb, out, args.iterations)
                results.append((mb, largest_bucket_mib(policy, mb), rows))
        finally:
            server.terminate()
            server.wait(timeout=60)
    print("GRPO on SmolLM2-135M (513 MiB fp32), 2 CPU ranks under ZeRO-3 + one server; "
          "per bucket size: the largest bucket, the sync's memory growth (max over ranks, "
          "per iteration) and seconds")  # fmt: skip
    print(f"{'bucket MiB':>10} {'largest':>8} {'growth MiB':>24} {'sync s':>14}")
    for mb, largest, rows in results:
        growth = ", ".join(f"{r['memory/sync_peak_mib']:.0f}" for r in rows)
        seconds = ", ".join(f"{r['time/weight_sync']:.1f}" for r in rows)
        print(f"{mb:>10g} {largest:8.0f} {growth:>24} {seconds:>14}")


if __name__ == "__main__":
    main()
    sys.exit(end_process())  # a rank leaves without interpreter teardown (api.end_process)
