"""`rlhf-dist report` draws the router metrics of routing replay (docs/moe.md) in a panel group
of their own, one line per layer, and not again among the "other" metrics."""

import json

from rlhf_dist.observability.report import build_report, load_stages, router_panels


def test_router_metrics_get_their_own_figure_with_a_line_per_layer(tmp_path):
    run = tmp_path / "ppo_moe"
    run.mkdir()
    rows = []
    for step in (1, 2, 3):
        row = {"step": step, "objective/score": 0.1 * step}
        for layer in (0, 1, 10):  # layer 10 sorts after 1, not between 1 and 2
            row[f"router/load_max/layer_{layer}"] = 0.2 + 0.01 * step
            row[f"router/entropy/layer_{layer}"] = 1.5 - 0.1 * step
            row[f"router/flip_rate/layer_{layer}"] = 0.03 / step
        row |= {"router/flip_rate": 0.03 / step, "router/logprob_gap_replayed": 0.05 / step,
                "router/logprob_gap_unreplayed": 0.07 / step}  # fmt: skip
        rows.append(row)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (stage,) = load_stages(run)
    panels = router_panels(stage)
    assert panels[0] == tuple(f"router/load_max/layer_{n}" for n in (0, 1, 10))
    assert ("router/logprob_gap_replayed", "router/logprob_gap_unreplayed") in panels
    assert ("router/flip_rate",) in panels
    index = build_report(run)  # report/index.html beside its PNGs
    router_png = [p.name for p in index.parent.glob("*router*.png")]
    assert len(router_png) == 1 and router_png[0] in index.read_text()
    assert not list(index.parent.glob("*other*.png"))  # nothing of the router's drawn twice
