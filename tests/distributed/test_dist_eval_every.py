"""run.eval_every under ZeRO-3 on 2 ranks: the evaluation during training keeps every rank
in lock-step on held-out sets that split unevenly (docs/metrics.md, "Evaluation during
training").

SFT's held-out NLL, KTO's new held-out evaluation (its reference log-probs in the
precomputed table) and PPO's `rlhf-dist eval` pass over the partitioned actor (gathered for
generation as in a rollout) with a partitioned reference and reward model, each after
every step, in ONE launch with a 120 s collective timeout (scripts/uneven_eval.py): a rank
left waiting for a forward its peer never runs fails the launch in two minutes.
"""

from __future__ import annotations

import json

from conftest import REPO, free_port, launch_args, run_launch
from test_dist_uneven_eval import TIMEOUT_S, first_rows

SCRIPT = str(REPO / "tests" / "distributed" / "scripts" / "uneven_eval.py")


def test_eval_every_step_stays_in_lock_step_under_zero3(assets, tmp_path):
    files, policy, reward = assets["files"], assets["policy"], assets["reward"]
    sft_eval = first_rows(files.sft, 33, tmp_path / "sft_eval.jsonl")  # 17 + 16 rows
    prefs = first_rows(files.prefs_train, 32, tmp_path / "prefs.jsonl")
    prefs_eval = first_rows(files.prefs_eval, 11, tmp_path / "prefs_eval.jsonl")
    common = [
        "run.log_every=1", "run.eval_every=1", "perf.num_threads=1",
        "distributed.frozen_models=partition", f"model.policy={policy}",
    ]  # fmt: skip

    def trained(stage: str, *extra: str) -> list[str]:
        return [
            *common, f"run.output_dir={tmp_path / stage}", f"{stage}.batch_size=32",
            f"{stage}.micro_batch_size=8", f"{stage}.epochs=1", *extra,
        ]  # fmt: skip

    # Uneven shares: SFT's 33 rows in passes of 8 are 3 passes on rank 0 and 2 on rank 1,
    # PPO's 9 prompts in chunks of 4 are 2 chunks and 1 (KTO's held-out sequences come in
    # pairs, completion and mismatched, so its shares are even).
    stages = {
        "sft": trained("sft", f"data.train={files.sft}", f"data.eval={sft_eval}"),
        "kto": trained("kto", f"data.train={prefs}", f"data.eval={prefs_eval}"),
        "ppo": [
            *common, f"model.reward={reward}", f"data.train={files.prompts}",
            f"data.eval={files.eval_prompts}", f"run.output_dir={tmp_path / 'ppo'}",
            "eval.num_prompts=9", "eval.batch_size=4", "ppo.iterations=2",
            "ppo.rollout_batch_size=32", "ppo.rollout_micro_batch_size=8",
            "ppo.minibatch_size=32", "ppo.micro_batch_size=8", "ppo.ppo_epochs=1",
            "generation.max_new_tokens=8",
        ],
    }  # fmt: skip
    # (Micro-batch 8 and accumulation 2 in every stage: DeepSpeed's batch entries, filled
    # at the first prepare, hold for every engine of the process.)
    args = []
    for name, overrides in stages.items():
        path = tmp_path / f"{name}.overrides"
        path.write_text("\n".join(overrides) + "\n", encoding="utf-8")
        args.append(f"{name}={path}")
    command = launch_args("cpu_zero3.yaml", free_port(), SCRIPT, str(TIMEOUT_S), *args)
    proc = run_launch(command, timeout=1200)
    names = {"sft": ("eval/loss",), "kto": ("eval/loss", "eval/kl", "eval/accuracy")}
    names["ppo"] = ("eval/score", "eval/kl_to_ref", "eval/length", "eval/length_corr")
    for name, steps in (("sft", 8), ("kto", 2), ("ppo", 2)):
        assert proc.stdout.count(f"UNEVEN-EVAL-OK {name}") == 1, (name, proc.stdout[-3000:])
        rows = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        evals = [r for r in map(json.loads, rows) if names[name][0] in r]
        assert [r["step"] for r in evals] == list(range(1, steps + 1)), name
        assert all(isinstance(r[n], float) for r in evals for n in names[name]), name
