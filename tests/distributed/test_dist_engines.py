"""FSDP2 and DeepSpeed ZeRO-3 train the same: at fp32, 2-rank runs of SFT, RM, DPO, KTO,
GRPO and iterate log the same metrics to 1e-5 under either engine (issue 52, "Metrics
match"); and FSDP2's sharded (torch.distributed.checkpoint) checkpoints resume exactly.

One launch per engine runs every stage back to back in one process per rank
(scripts/run_stages.py), the two engines' launches at once: a launch is ~10 s of imports
per rank, a stage on the tiny model a few seconds. Which of the other 2-rank tests also
run under FSDP2, and why: docs/distributed.md "Choosing the engine".
"""

from __future__ import annotations

import json
import math
import runpy
from pathlib import Path

import pytest
import torch
from conftest import REPO, free_port, launch_args, run_all

ENGINES = {"zero3": "cpu_zero3.yaml", "fsdp2": "cpu_fsdp2.yaml"}
STAGES = ("sft", "rm", "dpo", "kto", "grpo", "iterate")
RUN_STAGES = str(REPO / "tests" / "distributed" / "scripts" / "run_stages.py")


def first_lines(source: Path, n: int, target: Path) -> Path:
    target.write_text("".join(source.read_text().splitlines(True)[:n]))
    return target


def stage_commands(assets, root: Path) -> dict[str, list[str]]:
    """Two or three optimizer steps of each stage on the tiny assets, fp32 (model.dtype
    default). Every optimizer step is 16 rows (pairs for RM and DPO) in micro-batches of
    2: one process's stages share DeepSpeed's batch settings."""
    files = assets["files"]
    sft_rows = first_lines(files.sft, 48, root / "sft48.jsonl")
    pairs = first_lines(files.prefs_train, 32, root / "pairs32.jsonl")
    kto_pairs = first_lines(files.prefs_train, 16, root / "pairs16.jsonl")  # 32 examples
    held_out = first_lines(files.prefs_eval, 16, root / "held_out16.jsonl")
    common = [f"model.policy={assets['policy']}", "perf.num_threads=1", "run.log_every=1"]
    sizes = {
        s: [f"{s}.batch_size=16", f"{s}.micro_batch_size=2", f"{s}.optim.lr=1e-3"]
        for s in ("sft", "rm", "dpo", "kto")
    }
    ppo = [
        "ppo.minibatch_size=16",
        "ppo.micro_batch_size=2",
        "ppo.optim.lr=1e-3",
        "ppo.critic_optim.lr=1e-3",
        "generation.max_new_tokens=8",
    ]
    return {
        "sft": ["sft", *common, f"data.train={sft_rows}", f"run.output_dir={root / 'sft'}",
                *sizes["sft"], "run.checkpoint_every=1", "run.keep_checkpoints=3"],
        # with 16 held-out pairs: each rank evaluates 8, gathered for the summary
        "rm": ["rm", *common, f"data.train={pairs}", f"data.eval={held_out}",
               f"run.output_dir={root / 'rm'}", *sizes["rm"]],
        "dpo": ["dpo", *common, f"data.train={pairs}", f"run.output_dir={root / 'dpo'}",
                *sizes["dpo"]],
        "kto": ["kto", *common, f"data.train={kto_pairs}", f"run.output_dir={root / 'kto'}",
                *sizes["kto"]],
        "grpo": ["grpo", *common, f"data.train={files.prompts}",
                 f"run.output_dir={root / 'grpo'}", "ppo.iterations=2",
                 "ppo.rollout_batch_size=8", "ppo.samples_per_prompt=2", *ppo,
                 "reward.function=rlhf_dist.demo.task:positive_word_reward",
                 "run.checkpoint_every=1"],
        # One round: sample and label 40 pairs, RM steps, a PPO iteration with a critic
        # (the round's RM as reward model), the held-out evaluation. The random policy
        # rarely writes EOS and a pair needs both answers finished: a third of the words
        # stop an answer after its first 2 tokens.
        "iterate": ["iterate", *common, f"data.train={files.prompts}",
                    f"data.eval={files.eval_prompts}", f"run.output_dir={root / 'iterate'}",
                    "eval.gold_function=rlhf_dist.demo.task:gold_reward_eval",
                    "eval.num_prompts=8", "eval.batch_size=8", "iterate.rounds=1",
                    "iterate.pairs_per_round=40", "iterate.heldout_pairs=8", *sizes["rm"],
                    f"generation.stop_token_ids=[{','.join(map(str, range(20, 54)))}]",
                    "generation.min_new_tokens=2",
                    "ppo.iterations=1", "ppo.rollout_batch_size=16", "ppo.ppo_epochs=1", *ppo],
    }  # fmt: skip


def rows(out: Path) -> list[dict]:
    """The metrics rows of a run, without what measures the machine rather than the run."""
    machine = ("time/", "throughput/", "memory/")
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [
        {k: v for k, v in json.loads(line).items() if not k.startswith(machine)} for line in lines
    ]


def run_dir(root: Path, stage: str) -> list[Path]:
    """The directories of `stage` holding metrics.jsonl (iterate: its round's RM and PPO)."""
    if stage == "iterate":
        return [root / "iterate" / "round-1" / s for s in ("rm", "ppo")]
    return [root / stage]


def in_this_process(command: list[str]) -> None:
    """Run one stage in the test's own process (one rank, no launch: no imports to pay)."""
    runpy.run_path(RUN_STAGES)["run"](command)


def resumed(assets, stage: str, out: Path, checkpoint: Path) -> list[str]:
    command = stage_commands(assets, out.parent)[stage]
    return [*command, f"run.output_dir={out}", "--resume", str(checkpoint)]


@pytest.fixture(scope="module")
def one_process(assets, tmp_path_factory) -> Path:
    """The SFT run in one process (3 steps, each checkpointed whole in training.pt)."""
    root = tmp_path_factory.mktemp("one_process")
    in_this_process(stage_commands(assets, root)["sft"])
    return root / "sft"


@pytest.fixture(scope="module")
def runs(assets, one_process, tmp_path_factory) -> dict[str, Path]:
    """engine -> the directory holding its runs of every stage: one launch per engine
    running the stages in turn, the two launches at once, from an empty working directory
    (the shipped configs work from anywhere, issue item 7). The FSDP2 launch then resumes
    its own SFT and GRPO runs' step-1 shards (2 -> 2 ranks: two/, grpo_two/) and the
    one-process run's step-1 checkpoint (1 -> 2: grown/)."""
    roots = {engine: tmp_path_factory.mktemp(engine) for engine in ENGINES}
    commands = {e: list(stage_commands(assets, roots[e]).values()) for e in ENGINES}
    fsdp2 = roots["fsdp2"]
    commands["fsdp2"] += [
        resumed(assets, "sft", fsdp2 / "two", fsdp2 / "sft" / "checkpoints" / "step-000001"),
        resumed(assets, "sft", fsdp2 / "grown", one_process / "checkpoints" / "step-000001"),
        resumed(assets, "grpo", fsdp2 / "grpo_two", fsdp2 / "grpo" / "checkpoints" / "step-000001"),
    ]
    launches = [
        launch_args(config, free_port(), RUN_STAGES, json.dumps(commands[engine]))
        for engine, config in ENGINES.items()
    ]
    results = run_all(launches, 480, [{}, {}], cwd=tmp_path_factory.mktemp("cwd"))
    for engine, (code, out, err) in zip(ENGINES, results, strict=True):
        assert code == 0, f"{engine} exited {code}\n{(out + err)[-6000:]}"
    return roots


@pytest.fixture(scope="module")
def shrunk(assets, runs) -> Path:
    """The FSDP2 SFT run's step-1 shards resumed by one process (2 -> 1 ranks)."""
    out = runs["fsdp2"] / "shrunk"
    in_this_process(
        resumed(assets, "sft", out, runs["fsdp2"] / "sft" / "checkpoints" / "step-000001")
    )
    return out


# PPO with a critic: ZeRO-3 clips actor and critic at one global norm and logs that norm
# for both; FSDP2 clips and logs each group's own (docs/distributed.md "Choosing the engine").
GROUP_NORMS = ("optim/grad_norm_actor", "optim/grad_norm_critic")


def assert_close(a: list[dict], b: list[dict], what: str, tol: float, skip=()) -> int:
    """Every metric of rows `a` and `b` equal to `tol` (relative above 1), but the `skip`
    keys; how many floats were compared."""
    assert len(a) == len(b) >= 1, (what, len(a), len(b))
    compared = 0
    for step, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x.keys() == y.keys(), (what, step, x.keys() ^ y.keys())
        for key, u in x.items():
            v = y[key]
            if key in skip or ("dpo" in what and step == 0 and key == "rewards/accuracy"):
                continue  # DPO: the policy IS the reference, margins are noise around 0
            if isinstance(u, float) and math.isfinite(u):
                assert abs(u - v) <= tol * max(1.0, abs(u)), (what, step, key, u, v)
                compared += 1
            else:
                assert u == v or (u != u and v != v), (what, step, key, u, v)
    return compared


@pytest.mark.parametrize("stage", STAGES)
def test_fsdp2_metrics_equal_zero3_metrics(runs, stage):
    compared = 0
    for zero3, fsdp2 in zip(run_dir(runs["zero3"], stage), run_dir(runs["fsdp2"], stage)):
        skip = GROUP_NORMS if zero3.name == "ppo" else ()
        compared += assert_close(rows(zero3), rows(fsdp2), f"{stage} {zero3.name}", 1e-5, skip)
        assert (fsdp2 / "final" / "model.safetensors").is_file()  # the export: whole weights
    assert compared >= 10
    if stage == "iterate":
        # its one PPO step: ZeRO-3's global norm is the two groups' norms together
        (one,), (two,) = (rows(runs[e] / "iterate" / "round-1" / "ppo") for e in ENGINES)
        both = math.hypot(*(two[k] for k in GROUP_NORMS))
        assert one[GROUP_NORMS[0]] == one[GROUP_NORMS[1]] == pytest.approx(both, rel=1e-5)
        ends = [json.loads((runs[e] / "iterate" / "summary.json").read_text()) for e in ENGINES]
        assert_close(*[e["rounds"] for e in ends], "iterate summary", 1e-5, ("wall_seconds",))


def test_zero3_sft_and_rm_export_trained_models(assets, runs):
    """The ZeRO-3 launch's SFT export holds trained (gathered) weights, its RM gathered
    both ranks' halves of the 16 held-out pairs and exports a reward model with its head."""
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    before = load_file(str(Path(assets["policy"]) / "model.safetensors"))
    after = load_file(str(runs["zero3"] / "sft" / "final" / "model.safetensors"))
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before), "SFT did not train"
    rm = runs["zero3"] / "rm"
    assert json.loads((rm / "summary.json").read_text())["eval_pairs"] == 16
    model = AutoModelForSequenceClassification.from_pretrained(str(rm / "final"), num_labels=1)
    assert model.score.weight.abs().sum() > 0


def test_fsdp2_checkpoints_are_shards_and_the_export_whole(runs):
    step = runs["fsdp2"] / "sft" / "checkpoints" / "step-000001"
    assert sorted(p.name for p in (step / "training").glob("*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]  # each rank wrote its own shards
    assert not (step / "training.pt").exists()
    assert (runs["zero3"] / "sft" / "checkpoints" / "step-000001" / "training.pt").is_file()


def test_fsdp2_sharded_checkpoint_resumes_on_the_same_world_size_bitwise(runs):
    unbroken = rows(runs["fsdp2"] / "sft")
    assert rows(runs["fsdp2"] / "two") == unbroken[1:]  # steps 2 and 3, the same bits
    # GRPO: the actor's shards and moments, the rollout's RNG, the loop's state
    assert rows(runs["fsdp2"] / "grpo_two") == rows(runs["fsdp2"] / "grpo")[1:]


def test_fsdp2_sharded_checkpoint_resumes_on_one_process(runs, shrunk):
    """2 -> 1 ranks: the DCP shards read whole by one process; the unbroken run's metrics
    to 1e-6 at fp32 (one process sums the gradients in another order)."""
    unbroken = rows(runs["fsdp2"] / "sft")
    again = rows(shrunk)
    assert [r["step"] for r in again] == [2, 3]
    assert_close(unbroken[1:], again, "sft 2 -> 1 ranks", 1e-6)


def test_one_process_checkpoint_resumes_on_two_fsdp2_ranks(runs, one_process):
    """1 -> 2 ranks: a one-process checkpoint read into FSDP2's shards; the unbroken 2-rank
    run's metrics to 1e-6 at fp32 (its step 1 was one process's)."""
    unbroken = rows(runs["fsdp2"] / "sft")
    again = rows(runs["fsdp2"] / "grown")
    assert [r["step"] for r in again] == [2, 3]
    assert_close(unbroken[1:], again, "sft 1 -> 2 ranks", 1e-6)
