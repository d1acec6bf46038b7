"""The rollout server on the real SmolLM2-135M (docs/serving.md): what a weight sync and a
served rollout cost against in-process generation, on this machine.

Starts `rlhf-dist serve` on SmolLM2-135M-Instruct (fp32, perf.num_threads threads) on a
free port, then in this process, as trainer rank 0 would (generation/server.py):

1. the first sync (joining the weight-sync group, then every weight as version 1) and
   REPEATS more syncs, each with generation.server_sync_bucket_mb = BUCKET MiB, the
   post-sync check included: seconds each, and this process's peak RSS growth;
2. PROMPTS chat prompts x NEW tokens (temperature 0.7): served (POST /generate, one server)
   and in-process (the same decode loop and threads here), median of REPEATS seconds.

Both processes share the machine's cores: on a 2-core box the figures are an upper bound
of what a server on its own cores costs. Prints one table.

Usage: python launch/bench/serve.py [--threads 1] [--bucket 64] [--prompts 8] [--new 32]
       [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from rlhf_dist.config import config_from_dict
from rlhf_dist.data.rows import left_pad
from rlhf_dist.demo import smollm2
from rlhf_dist.distributed.weight_sync import free_port
from rlhf_dist.engine.decode import generate
from rlhf_dist.generation.server import ServerEngine, wait_healthy
from rlhf_dist.models import quiet_transformers
from rlhf_dist.models.loading import load_causal_lm, load_tokenizer, policy_stop_ids

TOKEN_ENV = "RLHF_DIST_BENCH_SERVER_TOKEN"
QUESTIONS = ["What is a good review?", "Name a fruit.", "Say hello.", "Count to three."]


def start_server(
    model: Path, port: int, threads: int, workdir: Path, dtype: str = "float32",
    batch_window_ms: float = 0.0,
) -> subprocess.Popen:  # fmt: skip
    config = workdir / "serve.yaml"
    tree = {"model": {"policy": str(model), "dtype": dtype},
            "serve": {"port": port, "token_env": TOKEN_ENV, "batch_window_ms": batch_window_ms},
            "perf": {"num_threads": threads}}  # fmt: skip
    config.write_text(json.dumps(tree))
    cmd = [sys.executable, "-m", "rlhf_dist", "serve", "--config", str(config)]
    proc = subprocess.Popen(cmd, env=os.environ | {"OMP_NUM_THREADS": str(threads)})
    if wait_healthy(f"http://127.0.0.1:{port}", 300, lambda: proc.poll() is None):
        return proc
    proc.kill()
    raise SystemExit("rlhf-dist serve did not start within 300 s")


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def bench_syncs(engine: ServerEngine, actor, repeats: int) -> list[tuple[str, float, float]]:
    rows = []
    for i in range(repeats + 1):
        with torch.no_grad():  # a new version each time, as after an optimizer step
            next(actor.parameters()).add_(1e-4)
        rss, start = peak_rss_mib(), time.perf_counter()
        engine.load_weights(actor)
        label = "first sync (join + send + check)" if i == 0 else f"sync {i} (send + check)"
        rows.append((label, time.perf_counter() - start, peak_rss_mib() - rss))
    return rows


def bench_generation(engine, actor, tokenizer, gen, stops, n_prompts: int, repeats: int):
    chats = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(n_prompts)]
    texts = [
        tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats
    ]
    seqs = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    ids, mask = left_pad(seqs, tokenizer.pad_token_id)
    served, local = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.generate(ids, mask, gen, stops, tokenizer.pad_token_id)
        served.append(time.perf_counter() - start)
        start = time.perf_counter()
        generate(actor, ids, mask, gen, tokenizer, None, stops)
        local.append(time.perf_counter() - start)
    return statistics.median(served), statistics.median(local)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--bucket", type=float, default=64.0, help="MiB per sync bucket")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new", type=int, default=32, help="new tokens per response")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    quiet_transformers()
    torch.set_num_threads(args.threads)
    os.environ.setdefault(TOKEN_ENV, os.urandom(16).hex())
    model_dir, port = smollm2.build("shipped"), free_port()
    cfg = config_from_dict(
        {"model": {"policy": str(model_dir)},
         "generation": {"backend": "server", "server_urls": [f"http://127.0.0.1:{port}"],
                        "server_token_env": TOKEN_ENV, "server_sync_bucket_mb": args.bucket,
                        "max_new_tokens": args.new, "min_new_tokens": args.new,
                        "temperature": 0.7}}
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(model_dir, port, args.threads, Path(tmp))
        try:
            actor = load_causal_lm(str(model_dir), "model.policy").eval()
            tokenizer = load_tokenizer(str(model_dir))
            engine = ServerEngine(cfg, is_main=True, any_rank=lambda flag: flag)
            syncs = bench_syncs(engine, actor, args.repeats)
            stops = policy_stop_ids(cfg, tokenizer)
            served, local = bench_generation(
                engine, actor, tokenizer, cfg.generation, stops, args.prompts, args.repeats
            )
        finally:
            server.terminate()
            server.wait(timeout=60)
    mib = sum(p.numel() * p.element_size() for p in actor.parameters()) / 2**20
    print(f"SmolLM2-135M fp32, {mib:.0f} MiB of weights, buckets of {args.bucket:g} MiB, "
          f"{args.threads} thread(s) per process")  # fmt: skip
    print(f"{'what':<44} {'seconds':>8} {'peak RSS growth MiB':>20}")
    for label, seconds, rss in syncs:
        print(f"{label:<44} {seconds:8.2f} {rss:20.0f}")
    what = f"{args.prompts} prompts x {args.new} tokens"
    print(f"{'served ' + what:<44} {served:8.2f}")
    print(f"{'in-process ' + what:<44} {local:8.2f}")


if __name__ == "__main__":
    main()
