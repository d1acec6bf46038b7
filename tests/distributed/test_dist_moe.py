"""Mixture-of-experts under 2-rank ZeRO-3 (docs/moe.md), two launches and one process
at once (the "off" launch waits out its gloo timeout meanwhile; the "on" launch runs the
2-rank SFT after its probe, in the same processes):

- a model whose experts are a module list, called only for the tokens routed to them,
  trains with its sparse block a ZeRO-3 leaf (models/moe.py); without that setting the
  ranks' fetches no longer match (it hangs until gloo's timeout, or fails): the test
  tests the fix;
- a tiny Qwen3-MoE (fused 3-D experts) trained by SFT with the load-balancing loss on 2
  ZeRO-3 ranks of 2 micro-batches each logs the one process's 4-micro-batch metrics, the
  loss's expert fractions counted over both ranks.

tests/distributed/scripts/moe_parity.py runs every family x stage this way, GRPO among
them (docs/moe.md); the suite keeps the SFT case, whose loss counts experts over ranks.
"""

import json
import sys

import pytest
from conftest import REPO, free_port, launch_args, run_all

PROBE = str(REPO / "tests/distributed/scripts/moe_leaf_probe.py")


def sft_command(policy: str, data: str, out) -> list[str]:
    return [
        "-m", "rlhf_dist", "sft", f"model.policy={policy}", f"data.train={data}",
        f"run.output_dir={out}", "run.log_every=1", "perf.num_threads=1", "sft.batch_size=8",
        "sft.micro_batch_size=2", "sft.optim.lr=3e-3", "model.router_aux_loss_coef=0.1",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def launches(assets, tmp_path_factory):
    """{name: (return code, output)} of the leaf probe on (then the SFT (Qwen3-MoE) run on
    2 ZeRO-3 ranks, two/) and off, and the SFT run in one process (one/); and the root
    their files are under."""
    from transformers import AutoTokenizer

    sys.path.insert(0, str(REPO / "tests"))
    from moe_models import tiny_moe

    root = tmp_path_factory.mktemp("moe")
    tokenizer = AutoTokenizer.from_pretrained(assets["policy"])
    policy = tiny_moe("qwen3_moe", tokenizer, root)
    rows = root / "sft16.jsonl"  # 2 steps of 8
    rows.write_text("".join(assets["files"].sft.read_text().splitlines(True)[:16]))
    two = json.dumps([sft_command(policy, str(rows), root / "two")[2:]])
    commands = {
        "on": launch_args("cpu_zero3.yaml", free_port(), PROBE, str(root / "on"), "on", two),
        "off": launch_args("cpu_zero3.yaml", free_port(), PROBE, str(root / "off"), "off"),
        "one": [sys.executable, *sft_command(policy, str(rows), root / "one")],
    }
    results = run_all(list(commands.values()), 240.0, [{}] * len(commands))
    return {k: (rc, out + err) for k, (rc, out, err) in zip(commands, results)}, root


def test_dist_moe_module_list_experts_need_leaf_blocks(launches):
    results, root = launches
    rc, output = results["on"]
    assert rc == 0, output[-4000:]
    ranks = [json.loads((root / f"on.{r}").read_text()) for r in (0, 1)]
    # provably different routing: rank 0's tokens all chose expert 0, rank 1's 1 and 2
    assert ranks[0]["experts"] == [0] and ranks[1]["experts"] == [1, 2]
    assert all(loss == loss for r in ranks for loss in r["losses"])  # finite, not NaN
    changed = ranks[0]["changed"]  # expert e: up, down; experts 0-2 trained, 3 never routed
    assert changed == [True] * 6 + [False] * 2
    rc, output = results["off"]
    assert rc != 0, "without the leaf setting the ranks' ZeRO-3 fetches must not match"
    assert not (root / "off.0").exists()
    assert "Timed out" in output or "Error" in output


def test_dist_moe_sft_zero3_two_ranks_equals_one_process(launches):
    results, root = launches
    for name in ("one", "on"):  # the 2-rank SFT ran in the "on" launch
        assert results[name][0] == 0, results[name][1][-4000:]
    a, b = (
        [json.loads(line) for line in (root / d / "metrics.jsonl").read_text().splitlines()]
        for d in ("one", "two")
    )
    steps = [(x, y) for x, y in zip(a, b, strict=True) if "sft/loss" in x]
    assert len(steps) == 2
    for x, y in steps:  # seen: 1e-8
        for key in ("sft/loss", "loss/router_aux", "sft/grad_norm"):
            assert abs(x[key] - y[key]) <= 1e-5 * max(1.0, abs(x[key])), (key, x[key], y[key])
