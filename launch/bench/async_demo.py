"""Does one-step-off-policy training learn the demo as well as on-policy training? The
offline demo's PPO stage (demo/pipeline.py stage_configs: PPO with a critic against the
demo's reward model) run three ways from the same SFT policy and reward model, trained
once: colocated generation (the demo as shipped), rollouts from a `rlhf-dist serve`
process on-policy (ppo.max_staleness=0) and one step off-policy (1). Each final policy is
evaluated as the demo evaluates it (held-out prompts, gold reward, KL to the SFT policy);
the off-policy run's logged staleness shows no rollout older than one update was trained
on (docs/serving.md, "Asynchronous rollouts").

`--ranks 2`: the PPO stage runs as 2 CPU ranks under ZeRO-3 (`accelerate launch` with
accelerate_configs/cpu_zero3.yaml, gloo), each rank sampling its shard through the server.

Usage: python launch/bench/async_demo.py [--seeds 0 1] [--ranks 1|2] [--out runs/bench/async_demo]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import TOKEN_ENV, start_server  # noqa: E402 (this folder's rollout-server benchmark)

from rlhf_dist.api import end_process
from rlhf_dist.config import config_from_dict  # noqa: E402
from rlhf_dist.demo import pipeline  # noqa: E402
from rlhf_dist.distributed.weight_sync import free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
MODES = {"colocated": None, "served, max_staleness 0": 0, "served, max_staleness 1": 1}


def ppo_tree(trees: dict, root: Path, name: str, url: str, staleness: int | None) -> dict:
    tree = copy.deepcopy(trees["ppo"])
    tree["run"]["output_dir"] = str(root / name)
    if staleness is not None:
        tree["generation"] |= {"backend": "server", "server_urls": [url],
                               "server_token_env": TOKEN_ENV}  # fmt: skip
        tree["ppo"]["max_staleness"] = staleness
    return tree


def train(tree: dict, ranks: int, runtime) -> None:
    """The PPO stage in this process, or as `ranks` ZeRO-3 CPU ranks."""
    from rlhf_dist.trainers.ppo import train_ppo

    if ranks == 1:
        train_ppo(config_from_dict(tree), runtime)
        return
    p = tree["ppo"]  # each rank's micro-batches: its share of a minibatch (same loss)
    p["micro_batch_size"] = min(p["micro_batch_size"], p["minibatch_size"] // ranks)
    config = Path(tree["run"]["output_dir"] + ".json")
    config.write_text(json.dumps(tree))
    cmd = [sys.executable, "-m", "accelerate.commands.launch",
           "--config_file", str(REPO / "accelerate_configs" / "cpu_zero3.yaml"),
           "--num_processes", str(ranks), "--main_process_port", str(free_port()),
           "-m", "rlhf_dist", "ppo", "--config", str(config)]  # fmt: skip
    subprocess.run(cmd, env=os.environ | {"OMP_NUM_THREADS": "1"}, check=True)


def one_seed(root: Path, seed: int, ranks: int) -> dict:
    """SFT and RM once, then the PPO stage each way and its evaluation -> figures."""
    from rlhf_dist.distributed import Runtime
    from rlhf_dist.evaluate import run_eval
    from rlhf_dist.trainers.reward import train_reward_model
    from rlhf_dist.trainers.sft import train_sft

    files, models = pipeline.task_and_models(root, seed)
    trees = pipeline.stage_configs(root, files, models, seed, quick=False, algorithm="ppo")
    runtime = Runtime(seed=seed)
    train_sft(config_from_dict(trees["sft"]), runtime)
    train_reward_model(config_from_dict(trees["rm"]), runtime)
    evaluate = config_from_dict(trees["eval"])
    figures = {
        "SFT": {
            "gold": run_eval(pipeline._with_output(evaluate, root / "eval_sft"), runtime)[
                "gold_reward"
            ]
        }
    }
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        server = start_server(root / "sft" / "final", port, 1, Path(tmp))
        try:
            for i, (mode, staleness) in enumerate(MODES.items()):
                name = f"ppo_{i}"
                start = time.perf_counter()
                url = f"http://127.0.0.1:{port}"
                train(ppo_tree(trees, root, name, url, staleness), ranks, runtime)
                seconds = time.perf_counter() - start
                ev = run_eval(
                    pipeline._with_output(
                        evaluate, root / f"eval_{name}", str(root / name / "final")
                    ),
                    runtime,
                )
                rows = [
                    json.loads(line)
                    for line in (root / name / "metrics.jsonl").read_text().splitlines()
                ]
                stale = max((r.get("rollout/staleness_max", 0.0) for r in rows), default=0.0)
                figures[mode] = {"gold": ev["gold_reward"], "kl": ev["kl_to_ref"],
                                 "seconds": seconds, "staleness_max": stale}  # fmt: skip
        finally:
            server.terminate()
            server.wait(timeout=60)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--ranks", type=int, default=1, choices=(1, 2))
    parser.add_argument("--out", default="runs/bench/async_demo")
    args = parser.parse_args()
    os.environ.setdefault(TOKEN_ENV, os.urandom(16).hex())
    out = Path(args.out).resolve()
    results = {seed: one_seed(out / f"seed{seed}", seed, args.ranks) for seed in args.seeds}
    print(f"The offline demo's PPO stage ({args.ranks} rank(s)) from the same SFT policy and "
          "reward model; held-out gold")  # fmt: skip
    print(f"{'seed':>4} {'way':<26} {'gold':>6} {'KL':>6} {'seconds':>8} {'staleness max':>13}")
    for seed, figures in results.items():
        print(f"{seed:>4} {'SFT':<26} {figures['SFT']['gold']:6.3f}")
        for mode in MODES:
            f = figures[mode]
            print(f"{seed:>4} {mode:<26} {f['gold']:6.3f} {f['kl']:6.2f} {f['seconds']:8.1f} "
                  f"{f['staleness_max']:13.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
    sys.exit(end_process())  # a rank leaves without interpreter teardown (api.end_process)
