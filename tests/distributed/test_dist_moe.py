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
