"""Unit tests of `rlhf-dist report` (rlhf_dist/report.py) on synthetic run directories.

The promises under test: every PNG is a real, non-blank image and the page links every
one of them; text from the run's files (samples, alerts, summaries) is escaped; missing
optional files are fine; a directory without metrics.jsonl is one ConfigError; the
demo's layout (sft, rm, ppo, eval/sft, eval/ppo) is found and shown in pipeline order.
"""

import json
import re

import pytest
from matplotlib import image as mpimg

from rlhf_dist.cli import main
from rlhf_dist.config import ConfigError
from rlhf_dist.observability.report import build_report

EVIL = "<script>alert('x')</script> & more"


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def histogram_row(step, name, shift):
    edges = [shift + i * 0.5 for i in range(5)]
    quantiles = {f"p{q:02d}": shift + q / 50 for q in (1, 5, 25, 50, 75, 95, 99)}
    counts = [1, 4, 6, 2]
    return {"step": step, "name": name, "edges": edges, "counts": counts,
            "quantiles": quantiles, "n": sum(counts), "mean": shift + 1.0}  # fmt: skip


def make_ppo(run, steps=(10, 20, 30), with_optional=True):
    """A PPO run dir; rows carry null, "nan" and "inf" values the way the logger writes them."""
    rows = [
        {
            "step": s,
            "objective/score": 0.1 * s,
            "objective/kl": 1 + s / 10,
            "objective/entropy": 2 - s / 100,
            "rollout/length": 12.0,
            "policy/loss": -0.01 * s,
            "value/loss": 1 / s,
            "policy/clipfrac": 0.1,
            "value/clipfrac": 0.2,
            "dist/kl/p50": 0.3,
            "alerts/kl_high": 1.0,
        }  # fmt: skip
        for s in steps
    ]
    rows[0] |= {"objective/score": "nan", "value/loss": None, "policy/loss": "inf"}
    write_jsonl(run / "metrics.jsonl", rows)
    (run / "summary.json").write_text(json.dumps({"iterations": 30, "score": 3.0, "note": EVIL}))
    if not with_optional:
        return
    dists = [histogram_row(s, n, s / 10) for s in steps for n in ("advantages", "kl")]
    write_jsonl(run / "distributions.jsonl", dists)
    samples = [
        {"step": s, "prompt": f"p{s}-{i}", "response": f"r{s}-{i}", "score": 1.0, "kl": 0.5}
        for s in steps
        for i in range(10)
    ]
    samples[-1]["response"] = EVIL  # step 30, the latest: shown
    write_jsonl(run / "samples.jsonl", samples)
    write_jsonl(run / "alerts.jsonl", [{"step": 20, "name": "kl_high", "message": EVIL}])


def make_demo(root):
    """The demo's layout: sft, rm, ppo, eval/sft, eval/ppo and a nested summary.json."""
    write_jsonl(root / "sft" / "metrics.jsonl", [{"step": s, "sft/loss": 3 / s} for s in (1, 2)])
    rm_rows = [{"step": s, "rm/loss": 1 / s, "rm/accuracy": 0.5 + s / 10} for s in (1, 2)]
    write_jsonl(root / "rm" / "metrics.jsonl", rm_rows + [{"step": 2, "rm/eval_accuracy": 0.8}])
    make_ppo(root / "ppo")
    for name in ("sft", "ppo"):
        write_jsonl(root / "eval" / name / "metrics.jsonl", [{"step": 0, "eval/score": 1.0}])
        write_jsonl(
            root / "eval" / name / "samples.jsonl",
            [{"prompt": "q", "response": f"{name} answer", "score": 1.0}],
        )
    # Below a stage: not a stage of its own (a stage's subdirectories are not searched).
    write_jsonl(root / "ppo" / "nested" / "metrics.jsonl", [{"step": 1, "x": 1.0}])
    (root / "summary.json").write_text(json.dumps({"ppo": {"gold_reward": 0.987}}))


@pytest.fixture(scope="module")
def ppo_report(tmp_path_factory):
    """One PPO report shared by the tests that only read it (drawing is the slow part)."""
    run = tmp_path_factory.mktemp("runs") / "ppo_run"
    make_ppo(run)
    return build_report(run)


def pngs(directory):
    return sorted(p.name for p in directory.glob("*.png"))


def assert_real_png(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    assert mpimg.imread(path).std() > 0, f"{path} is blank"


def test_ppo_run_pngs_are_real_and_all_linked(ppo_report):
    index = ppo_report
    assert index.parent.name == "report" and index.name == "index.html"
    names = pngs(index.parent)
    for stem in ("ppo_score_kl", "ppo_entropy_length", "ppo_losses"):
        assert f"ppo_run_{stem}.png" in names
    for dist in ("advantages", "kl"):  # latest histogram and quantile bands per name
        assert f"ppo_run_hist_{dist}.png" in names
        assert f"ppo_run_quantiles_{dist}.png" in names
    for name in names:
        assert_real_png(index.parent / name)
    page = index.read_text(encoding="utf-8")
    linked = set(re.findall(r"<img src='([^']+)'", page))
    assert linked == set(names)
    assert "http" not in page and "<script" not in page  # self-contained, nothing runs


def test_text_from_the_run_is_escaped(ppo_report):
    page = ppo_report.read_text(encoding="utf-8")
    assert "<script>" not in page
    escaped = "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; more"
    assert page.count(escaped) == 3  # summary, alert message, sample


def test_samples_latest_step_first_and_capped(ppo_report):
    page = ppo_report.read_text(encoding="utf-8")
    samples = page[page.index("<table class='samples'>") :]
    shown = re.findall(r"<td class='text'>(r\d+-\d+|&lt;script)", samples)
    assert len(shown) == 20  # 30 samples, at most 20 shown
    assert shown[0] == "r30-0" and "r10-0" not in shown


def test_missing_optional_files_are_fine(tmp_path):
    run = tmp_path / "ppo"
    make_ppo(run, with_optional=False)
    (run / "summary.json").unlink()
    index = build_report(run, output=tmp_path / "elsewhere")
    assert index == tmp_path / "elsewhere" / "index.html"
    names = pngs(index.parent)
    assert names and not [n for n in names if "_hist_" in n or "_quantiles_" in n]
    page = index.read_text(encoding="utf-8")
    assert "Samples" not in page and "Alerts" not in page and "Distributions" not in page


def test_one_histogram_step_draws_no_band(tmp_path):
    run = tmp_path / "ppo"
    make_ppo(run, steps=(10,))
    names = pngs(build_report(run).parent)
    assert "ppo_hist_kl.png" in names and "ppo_quantiles_kl.png" not in names


def test_without_metrics_is_a_config_error(tmp_path):
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "summary.json").write_text("{}")
    with pytest.raises(ConfigError, match="no metrics.jsonl"):
        build_report(tmp_path)
    with pytest.raises(ConfigError, match="not a directory"):
        build_report(tmp_path / "missing")
    assert not (tmp_path / "report").exists()


def test_demo_layout_is_found_in_pipeline_order(tmp_path):
    make_demo(tmp_path)
    page = build_report(tmp_path).read_text(encoding="utf-8")
    sections = re.findall(r"<section id='([^']+)'>", page)
    assert sections == ["sft", "rm", "ppo", "eval_ppo", "eval_sft"]
    assert "ppo.gold_reward" in page and "0.987" in page  # the top-level summary
    assert page.index("ppo.gold_reward") < page.index("<section")
    names = pngs(tmp_path / "report")
    assert {"sft_sft_loss.png", "rm_rm_loss_accuracy.png", "ppo_ppo_score_kl.png"} <= set(names)
    assert not [n for n in names if "nested" in n or n.startswith("eval")]
    assert "sft answer" in page and "ppo answer" in page  # eval samples, which have no step


def test_cli_prints_the_page_and_errors_in_one_line(tmp_path, capsys):
    run = tmp_path / "sft"
    write_jsonl(run / "metrics.jsonl", [{"step": s, "sft/loss": 3 / s} for s in (1, 2)])
    assert main(["report", str(run)]) == 0
    assert capsys.readouterr().out.strip() == str(run / "report" / "index.html")
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("rlhf-dist report: error:")
    with pytest.raises(SystemExit) as exit_info:
        main(["report", "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("usage: rlhf-dist report")


def test_odd_names_and_values_do_not_break_plots(tmp_path):
    """A "$" pair in a directory name would be mathtext; strings and NaN-only metrics
    must be skipped or counted, not crash the report."""
    run = tmp_path / "run_$\\notacommand{$"
    rows = [{"step": s, "sft/loss": 1 / s, "custom/x": "nan", "note": "text"} for s in (1, 2)]
    write_jsonl(run / "metrics.jsonl", rows + [{"step": "bad", "sft/loss": 9.0}])
    (run / "distributions.jsonl").write_text('{"step": 1, "name": "kl", "edges": [0]}\n{cut')
    index = build_report(run)
    names = pngs(index.parent)
    assert "run_notacommand_sft_loss.png" in names and "run_notacommand_other.png" in names
    for name in names:
        assert_real_png(index.parent / name)


def test_dpo_and_kto_runs_get_their_own_sections_and_panels(tmp_path):
    write_jsonl(tmp_path / "sft" / "metrics.jsonl", [{"step": 1, "sft/loss": 2.0}])
    for stage, extra in (
        ("dpo", {"rewards/chosen": 0.1, "rewards/rejected": -0.1, "logprobs/chosen": -9.0}),
        ("kto", {"rewards/desirable": 0.2, "rewards/undesirable": -0.2, "kto/kl": 0.05}),
    ):
        rows = [
            {"step": s, f"{stage}/loss": 0.7 - s / 100, "rewards/margins": s / 100,
             "rewards/accuracy": 0.5 + s / 100, f"{stage}/grad_norm": 1.0, **extra}
            for s in (1, 2, 3)
        ]  # fmt: skip
        write_jsonl(tmp_path / stage / "metrics.jsonl", rows)
    page = build_report(tmp_path).read_text(encoding="utf-8")
    assert re.findall(r"<section id='([^']+)'>", page) == ["sft", "dpo", "kto"]
    assert "DPO: dpo" in page and "KTO: kto" in page
    names = set(pngs(tmp_path / "report"))
    for stage in ("dpo", "kto"):
        assert {f"{stage}_preference_loss.png", f"{stage}_preference_optim.png"} <= names
