"""Evaluation that splits unevenly over 2 ranks finishes in every stage (issue 22), under
ZeRO-3 and (opt-in, docs/distributed.md) FSDP2.

Under ZeRO-3 every forward pass is a collective (under FSDP2 each forward of a trained
model outside its whole-weights contexts), so a forward-only loop whose ranks run
different numbers of passes hangs until distributed.timeout_s: `rlhf-dist sft` with a
33-row data.eval in micro-batches of 8 did (17 rows = 3 passes on rank 0, 16 = 2 on rank 1)
and lost its trained model. Every stage that evaluates or scores runs here in ONE launch
(scripts/uneven_eval.py, one process group) on eval sets of odd size whose shares the
micro-batch divides on neither rank, with frozen models partitioned (replicated under
FSDP2, which partitions none), and a 120 s collective timeout: a hang fails the launch in
two minutes, not thirty.

run.eval_every under ZeRO-3 (docs/metrics.md, "Evaluation during training") runs in the
same ZeRO-3 launch, after those stages: SFT's held-out NLL, KTO's held-out evaluation (its
reference log-probs in the precomputed table) and PPO's `rlhf-dist eval` pass over the
partitioned actor (gathered for generation as in a rollout) with a partitioned reference
and reward model, each after every step, on held-out sets that split unevenly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import ENGINES, REPO, engines, free_port, launch_args, run_launch

SCRIPT = str(REPO / "tests" / "distributed" / "scripts" / "uneven_eval.py")
TIMEOUT_S = 120  # distributed.timeout_s of the launch: a hang fails after this


def first_rows(src: Path, n: int, dst: Path) -> Path:
    """The first n rows of a JSON-lines file, written to dst."""
    lines = src.read_text(encoding="utf-8").splitlines()[:n]
    assert len(lines) == n
    dst.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return dst


def stage_overrides(assets, root: Path, frozen: str) -> dict[str, list[str]]:
    files = assets["files"]
    sft_train = first_rows(files.sft, 64, root / "sft_train.jsonl")
    sft_eval = first_rows(files.sft, 33, root / "sft_eval.jsonl")  # the 33-row case
    prefs_train = first_rows(files.prefs_train, 64, root / "prefs_train.jsonl")
    prefs_eval = first_rows(files.prefs_eval, 33, root / "prefs_eval.jsonl")
    prompts = first_rows(files.prompts, 33, root / "prompts.jsonl")
    policy, reward = assets["policy"], assets["reward"]
    common = ["run.log_every=1", "perf.num_threads=1", f"distributed.frozen_models={frozen}"]

    def trained(stage: str, data: list[str], *extra: str) -> list[str]:
        return [
            f"model.policy={policy}", *data, f"run.output_dir={root / stage}", *common,
            f"{stage}.batch_size=32", f"{stage}.micro_batch_size=8", f"{stage}.epochs=1",
            *extra,
        ]  # fmt: skip

    prefs = [f"data.train={prefs_train}", f"data.eval={prefs_eval}"]
    return {
        # 33 rows in micro-batches of 8: 17 rows (3 passes) on rank 0, 16 (2) on rank 1.
        "sft": trained("sft", [f"data.train={sft_train}", f"data.eval={sft_eval}"]),
        # 33 held-out pairs likewise, then the rephrasing probe over uneven shares.
        "rm": trained("rm", prefs),
        # Online reference: the eval scores 66 sequences with the policy and the
        # partitioned reference, 33 per rank in passes of 16 (16 + 16 + 1).
        "dpo": trained("dpo", prefs, "dpo.reference_logprobs=online"),
        # The reference table (2 x 128 sequences, passes of 16) and z0 every step.
        "kto": trained("kto", [f"data.train={prefs_train}"], "kto.reference_logprobs=precompute"),
        # 33 prompts in chunks of 8 (3 chunks on rank 0, 2 on rank 1), the reward model's
        # probe on each rank's finished responses (uneven by nature).
        "eval": [
            f"model.policy={policy}",
            f"model.reward={reward}",
            f"data.train={prompts}",
            f"run.output_dir={root / 'eval'}",
            *common,
            "eval.num_prompts=33",
            "eval.batch_size=8",
            f"eval.reference={policy}",
            "generation.max_new_tokens=8",
        ],  # fmt: skip
        # Rollout scoring in micro-batches of 3 over 16 prompts per rank (5 x 3 + 1) with a
        # partitioned reward model and reference. (Micro-batch 8 and accumulation 2 as the
        # stages before: DeepSpeed's batch entries, filled at the first prepare, hold for
        # every engine of the process.)
        "ppo": [
            f"model.policy={policy}",
            f"model.reward={reward}",
            f"data.train={prompts}",
            f"run.output_dir={root / 'ppo'}",
            *common,
            "ppo.iterations=2",
            "ppo.rollout_batch_size=32",
            "ppo.rollout_micro_batch_size=3",
            "ppo.minibatch_size=32",
            "ppo.micro_batch_size=8",
            "ppo.ppo_epochs=1",
            "generation.max_new_tokens=8",
        ],  # fmt: skip
    }


def eval_every_overrides(assets, root: Path) -> dict[str, list[str]]:
    """SFT, KTO and PPO evaluating after every step under ZeRO-3 (tags sft/every, ...)."""
    files, policy, reward = assets["files"], assets["policy"], assets["reward"]
    sft_eval = first_rows(files.sft, 33, root / "every_sft_eval.jsonl")  # 17 + 16 rows
    prefs = first_rows(files.prefs_train, 32, root / "every_prefs.jsonl")
    prefs_eval = first_rows(files.prefs_eval, 11, root / "every_prefs_eval.jsonl")
    common = [
        "run.log_every=1", "run.eval_every=1", "perf.num_threads=1",
        "distributed.frozen_models=partition", f"model.policy={policy}",
    ]  # fmt: skip

    def trained(stage: str, *extra: str) -> list[str]:
        return [
            *common, f"run.output_dir={root / 'every' / stage}", f"{stage}.batch_size=32",
            f"{stage}.micro_batch_size=8", f"{stage}.epochs=1", *extra,
        ]  # fmt: skip

    # Uneven shares: SFT's 33 rows in passes of 8 are 3 passes on rank 0 and 2 on rank 1,
    # PPO's 9 prompts in chunks of 4 are 2 chunks and 1 (KTO's held-out sequences come in
    # pairs, completion and mismatched, so its shares are even).
    return {
        "sft/every": trained("sft", f"data.train={files.sft}", f"data.eval={sft_eval}"),
        "kto/every": trained("kto", f"data.train={prefs}", f"data.eval={prefs_eval}"),
        "ppo/every": [
            *common, f"model.reward={reward}", f"data.train={files.prompts}",
            f"data.eval={files.eval_prompts}", f"run.output_dir={root / 'every' / 'ppo'}",
            "eval.num_prompts=9", "eval.batch_size=4", "ppo.iterations=2",
            "ppo.rollout_batch_size=32", "ppo.rollout_micro_batch_size=8",
            "ppo.minibatch_size=32", "ppo.micro_batch_size=8", "ppo.ppo_epochs=1",
            "generation.max_new_tokens=8",
        ],
    }  # fmt: skip


def launch(engine: str, root: Path, stages: dict[str, list[str]]) -> list[str]:
    """ONE launch of scripts/uneven_eval.py under `engine` running `stages` in turn (micro-
    batch 8 and accumulation 2 in every stage: DeepSpeed's batch entries, filled at the
    first prepare, hold for every engine of the process) -> the lines it printed."""
    args = []
    for name, overrides in stages.items():
        path = root / f"{name.replace('/', '_')}.overrides"
        path.write_text("\n".join(overrides) + "\n", encoding="utf-8")
        args.append(f"{name}={path}")
    command = launch_args(ENGINES[engine], free_port(), SCRIPT, str(TIMEOUT_S), *args)
    return run_launch(command, timeout=1500).stdout.splitlines()


@pytest.fixture(scope="module")
def zero3(assets, tmp_path_factory) -> tuple[Path, list[str], list[str]]:
    """The ZeRO-3 launch: every evaluating stage on uneven shares, then the eval_every
    runs -> (its root, the lines it printed, the uneven stages' names)."""
    root = tmp_path_factory.mktemp("zero3")
    uneven = stage_overrides(assets, root, "partition")
    return root, launch("zero3", root, uneven | eval_every_overrides(assets, root)), list(uneven)


# FSDP2 opt-in: the lock-step loops are the same code under both engines (lockstep.py).
@pytest.mark.parametrize("engine", engines())
def test_every_evaluating_stage_finishes_on_uneven_shares(assets, engine, request, tmp_path):
    if engine == "zero3":
        root, lines, stages = request.getfixturevalue("zero3")
    else:
        root, overrides = tmp_path, stage_overrides(assets, tmp_path, "replicate")
        lines, stages = launch(engine, root, overrides), list(overrides)
    for name in stages:
        assert lines.count(f"UNEVEN-EVAL-OK {name}") == 1, (name, lines[-30:])
        summary = json.loads((root / name / "summary.json").read_text())
        assert summary, name
        if name != "eval":  # eval trains nothing; every other stage exports its model
            assert (root / name / "final" / "model.safetensors").is_file(), name
    sft = json.loads((root / "sft" / "summary.json").read_text())
    assert sft["eval_loss"] > 0 and sft["train_examples"] == 64
    rm = json.loads((root / "rm" / "summary.json").read_text())
    assert rm["eval_pairs"] == 33 and 0 <= rm["eval_accuracy"] <= 1
    assert json.loads((root / "dpo" / "summary.json").read_text())["eval_pairs"] == 33
    ev = json.loads((root / "eval" / "summary.json").read_text())
    samples = (root / "eval" / "samples.jsonl").read_text().splitlines()
    assert len(samples) == 33 and "kl_to_ref" in ev and "length_corr" in ev


def test_eval_every_step_stays_in_lock_step_under_zero3(zero3):
    root, lines, _ = zero3
    names = {"sft": ("eval/loss",), "kto": ("eval/loss", "eval/kl", "eval/accuracy")}
    names["ppo"] = ("eval/score", "eval/kl_to_ref", "eval/length", "eval/length_corr")
    for name, steps in (("sft", 8), ("kto", 2), ("ppo", 2)):
        assert lines.count(f"UNEVEN-EVAL-OK {name}/every") == 1, (name, lines[-30:])
        rows = (root / "every" / name / "metrics.jsonl").read_text().splitlines()
        evals = [r for r in map(json.loads, rows) if names[name][0] in r]
        assert [r["step"] for r in evals] == list(range(1, steps + 1)), name
        assert all(isinstance(r[n], float) for r in evals for n in names[name]), name
