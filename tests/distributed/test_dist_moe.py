"""Mixture-of-experts under 2-rank ZeRO-3 (docs/moe.md): a model whose experts are a
module list, called only for the tokens routed to them, trains with its sparse block a
ZeRO-3 leaf (models/moe.py), and without that setting the ranks' fetches no longer
match (it hangs until gloo's timeout, or fails): the test tests the fix."""

import json

from conftest import REPO, free_port, launch_args, run_all

PROBE = str(REPO / "tests/distributed/scripts/moe_leaf_probe.py")


def test_dist_moe_module_list_experts_need_leaf_blocks(tmp_path):
    # both launches at once: the "off" one waits out its 8 s gloo timeout meanwhile
    runs = [
        launch_args("cpu_zero3.yaml", free_port(), PROBE, str(tmp_path / mode), mode)
        for mode in ("on", "off")
    ]
    (on_rc, on_out, on_err), (off_rc, off_out, off_err) = run_all(runs, 150.0, [{}, {}])
    assert on_rc == 0, (on_out + on_err)[-4000:]
    ranks = [json.loads((tmp_path / f"on.{r}").read_text()) for r in (0, 1)]
    # provably different routing: rank 0's tokens all chose expert 0, rank 1's 1 and 2
    assert ranks[0]["experts"] == [0] and ranks[1]["experts"] == [1, 2]
    assert all(loss == loss for r in ranks for loss in r["losses"])  # finite, not NaN
    changed = ranks[0]["changed"]  # expert e: up, down; experts 0-2 trained, 3 never routed
    assert changed == [True] * 6 + [False] * 2
    assert off_rc != 0, "without the leaf setting the ranks' ZeRO-3 fetches must not match"
    assert not (tmp_path / "off.0").exists()
    assert "Timed out" in off_out + off_err or "Error" in off_out + off_err


def sft_command(policy: str, data: str, out) -> list[str]:
    return [
        "-m", "rlhf_dist", "sft", f"model.policy={policy}", f"data.train={data}",
        f"run.output_dir={out}", "run.log_every=1", "perf.num_threads=1", "sft.batch_size=8",
        "sft.micro_batch_size=2", "sft.optim.lr=3e-3", "model.router_aux_loss_coef=0.1",
    ]  # fmt: skip


def test_dist_moe_sft_zero3_two_ranks_equals_one_process(assets, tmp_path):
    """A tiny Qwen3-MoE (fused 3-D experts) trained by SFT with the load-balancing loss:
    2 ZeRO-3 ranks of 2 micro-batches each log the one process's 4-micro-batch metrics,
    the loss's expert fractions counted over both ranks."""
    import sys

    from transformers import AutoTokenizer

    sys.path.insert(0, str(REPO / "tests"))
    from moe_models import tiny_moe

    tokenizer = AutoTokenizer.from_pretrained(assets["policy"])
    policy = tiny_moe("qwen3_moe", tokenizer, tmp_path)
    rows = tmp_path / "sft16.jsonl"  # 2 steps of 8
    rows.write_text("".join(assets["files"].sft.read_text().splitlines(True)[:16]))
    one, two = tmp_path / "one", tmp_path / "two"
    runs = [
        [sys.executable, *sft_command(policy, str(rows), one)],
        launch_args("cpu_zero3.yaml", free_port(), *sft_command(policy, str(rows), two)),
    ]
    for rc, out, err in run_all(runs, 240.0, [{}, {}]):
        assert rc == 0, (out + err)[-4000:]
    a, b = (
        [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
        for d in (one, two)
    )
    steps = [(x, y) for x, y in zip(a, b, strict=True) if "sft/loss" in x]
    assert len(steps) == 2
    for x, y in steps:
        for key in ("sft/loss", "loss/router_aux", "sft/grad_norm"):
            assert abs(x[key] - y[key]) <= 1e-5 * max(1.0, abs(x[key])), (key, x[key], y[key])
