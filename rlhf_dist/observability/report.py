"""`rlhf-dist report PATH`: PNG plots and one HTML page of a run, for users without W&B.

PATH is one run directory (a stage's `run.output_dir`) or a directory of run directories
such as the demo's (any subdirectory up to two levels down with a metrics.jsonl is a
stage). Each stage gets its curves (metrics.jsonl), the latest histogram of every
distribution and its quantile bands over steps (distributions.jsonl), its alerts
(alerts.jsonl), its summary.json and its samples (samples.jsonl); everything but
metrics.jsonl is optional. The page is self-contained: no JavaScript, no network, images
by relative links. matplotlib is drawn through the Agg canvas directly (never pyplot), so
building a report never opens a window nor changes the backend of a caller's process.
"""

from __future__ import annotations

import html
import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlhf_dist.errors import ConfigError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# (file stem, title, panels): each panel is one axes with the series named; a group is
# drawn when any of its series has a value. Known names: docs/metrics.md.
PANEL_GROUPS = (
    ("sft_loss", "SFT loss", (("sft/loss", "sft/eval_loss"),)),
    ("sft_optim", "SFT optimizer", (("sft/grad_norm",), ("sft/lr",), ("sft/epoch",))),
    (
        "rm_loss_accuracy",
        "Reward model loss & accuracy",
        (("rm/loss", "rm/eval_loss"), ("rm/accuracy", "rm/eval_accuracy")),
    ),
    ("rm_optim", "Reward model optimizer", (("rm/grad_norm",), ("rm/lr",), ("rm/epoch",))),
    (
        "preference_loss",
        "DPO / KTO loss & implicit rewards",
        (
            ("dpo/loss", "kto/loss", "dpo/eval_loss"),
            ("rewards/chosen", "rewards/rejected", "rewards/desirable", "rewards/undesirable"),
            ("rewards/margins", "dpo/eval_margins"),
            ("rewards/accuracy", "dpo/eval_accuracy"),
        ),
    ),
    (
        "preference_optim",
        "DPO / KTO reference & optimizer",
        (
            ("logprobs/chosen", "logprobs/rejected", "kto/kl"),
            ("dpo/grad_norm", "kto/grad_norm"),
            ("dpo/lr", "kto/lr"),
        ),
    ),
    (
        "online_dpo_pairs",
        "Online DPO pairs: the labeller's scores & ties",
        (
            ("online_dpo/score_chosen", "online_dpo/score_rejected", "online_dpo/score_margin"),
            ("online_dpo/tie_fraction",),
            ("online_dpo/pairs",),
        ),
    ),
    (
        "ppo_score_kl",
        "Score & KL",
        (
            ("objective/score", "objective/raw_score", "objective/rlhf_reward"),
            ("objective/kl",),
        ),
    ),
    (
        "ppo_entropy_length",
        "Entropy & response length",
        (
            ("objective/entropy",),
            ("rollout/length", "rollout/length_min", "rollout/length_max"),
            ("entropy/coef",),
        ),
    ),
    (
        "ppo_losses",
        "Losses & clip fractions",
        (("policy/loss",), ("value/loss",), ("policy/clipfrac", "value/clipfrac")),
    ),
    (
        "ppo_health",
        "Update health",
        (
            ("policy/approx_kl",),
            ("value/explained_variance",),
            ("objective/score_std",),
            ("rollout/eos_rate",),
        ),
    ),
    (
        "ppo_values",
        "Values, advantages & ratios",
        (
            ("value/returns", "value/values"),
            ("advantages/raw", "advantages/raw_std"),
            ("policy/ratio_mean", "policy/ratio_max"),
        ),
    ),
    (
        "ppo_optim",
        "Optimizer",
        (
            ("optim/grad_norm_actor", "optim/grad_norm_critic"),
            ("optim/kl_coef",),
            ("optim/lr_actor",),
        ),
    ),
    (
        "time",
        "Time per step (s) & throughput",
        (
            ("time/total", "time/rollout", "time/update", "time/generate", "time/score"),
            ("throughput/response_tokens_per_s",),
            ("throughput/samples_per_s",),
            ("memory/peak_gib",),
        ),
    ),
)
# Per-layer router metrics (router/<kind>/layer_<l>), one panel per kind (`router_panels`).
ROUTER_KINDS = ("load_max", "load_min", "entropy", "flip_rate")
# Shown elsewhere on the page: dist/<name>/<q> as quantile bands, alerts/<name> as a table.
NOT_IN_OTHER = ("dist/", "alerts/")
MAX_OTHER_PANELS = 12
MAX_SAMPLES = 20
KIND_ORDER = {"sft": 0, "rm": 1, "ppo": 2, "dpo": 2, "kto": 2, "eval": 3, "run": 4}
KIND_TITLE = {
    "sft": "SFT",
    "rm": "Reward model",
    "ppo": "PPO",
    "dpo": "DPO",
    "kto": "KTO",
    "eval": "Evaluation",
    "run": "Run",
}


@dataclass
class Series:
    """One metric over steps; non-finite values are counted, not drawn."""

    steps: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    nonfinite: int = 0


@dataclass
class Stage:
    """One run directory and everything read from it."""

    path: Path
    label: str  # path relative to the report's PATH, e.g. "eval/ppo"
    slug: str  # prefix of its PNG file names
    kind: str
    series: dict[str, Series]
    distributions: list[dict]
    samples: list[dict]
    alerts: list[dict]
    summary: dict | None


@dataclass
class Plot:
    file: str
    caption: str


# ---------------------------------------------------------------- reading


def read_jsonl(path: Path) -> list[dict]:
    """The JSON objects of a JSON-lines file; [] when absent. A line cut short by a kill
    or otherwise unparsable is skipped: a report must not fail on a crashed run."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def read_json(path: Path) -> dict | None:
    """A JSON object file, or None when absent or unreadable."""
    try:
        value = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, json.JSONDecodeError):
        return None
    return value if isinstance(value, dict) else None


def as_number(value: Any) -> float | None:
    """A finite float, math.nan for a non-finite one (the logger writes "nan"/"inf" as
    text), None for anything that is not a number (bools included)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value) if math.isfinite(value) else math.nan
    if isinstance(value, str) and value.strip().lower() in ("nan", "inf", "-inf", "+inf"):
        return math.nan
    return None


def finite(value: Any) -> float | None:
    """A finite float, else None."""
    x = as_number(value)
    return x if x is not None and math.isfinite(x) else None


def metric_series(rows: list[dict]) -> dict[str, Series]:
    """name -> Series from metrics.jsonl rows; rows without a numeric step are skipped."""
    series: dict[str, Series] = {}
    for row in rows:
        step = as_number(row.get("step"))
        if step is None or math.isnan(step):
            continue
        for name, raw in row.items():
            value = as_number(raw)
            if name == "step" or value is None:
                continue
            s = series.setdefault(name, Series())
            if math.isnan(value):
                s.nonfinite += 1
            else:
                s.steps.append(step)
                s.values.append(value)
    return series


def stage_kind(names: Iterable[str]) -> str:
    """sft / rm / ppo / dpo / kto / eval from the metric names' prefixes; "run" when none match."""
    prefixes = {name.split("/", 1)[0] for name in names}
    for kind, marks in (
        ("ppo", {"objective", "policy"}),
        ("sft", {"sft"}),
        ("rm", {"rm"}),
        ("dpo", {"dpo"}),
        ("kto", {"kto"}),
        ("eval", {"eval"}),
    ):
        if prefixes & marks:
            return kind
    return "run"


def find_run_dirs(root: Path) -> list[Path]:
    """root itself when it holds metrics.jsonl, else every subdirectory up to two levels
    down that does (a stage's own subdirectories, e.g. checkpoints, are not searched)."""
    if not root.is_dir():
        raise ConfigError(f"{root}: not a directory")
    if (root / "metrics.jsonl").is_file():
        return [root]
    found = []
    for child in sorted(p for p in root.iterdir() if p.is_dir()):
        if (child / "metrics.jsonl").is_file():
            found.append(child)
            continue
        found += sorted(
            g for g in child.iterdir() if g.is_dir() and (g / "metrics.jsonl").is_file()
        )
    if not found:
        raise ConfigError(
            f"{root}: no metrics.jsonl in it or in its subdirectories (two levels down); "
            "pass a run's output_dir or a directory of runs"
        )
    return found


def load_stage(path: Path, root: Path, used_slugs: set[str]) -> Stage:
    """Read one run directory; its slug is unique among the report's stages."""
    label = path.relative_to(root).as_posix() if path != root else path.resolve().name
    slug = re.sub(r"[^A-Za-z0-9]+", "_", label).strip("_") or "run"
    base, n = slug, 2
    while slug in used_slugs:
        slug, n = f"{base}_{n}", n + 1
    used_slugs.add(slug)
    series = metric_series(read_jsonl(path / "metrics.jsonl"))
    return Stage(
        path=path,
        label=label,
        slug=slug,
        kind=stage_kind(series),
        series=series,
        distributions=read_jsonl(path / "distributions.jsonl"),
        samples=read_jsonl(path / "samples.jsonl"),
        alerts=read_jsonl(path / "alerts.jsonl"),
        summary=read_json(path / "summary.json"),
    )


def load_stages(root: Path) -> list[Stage]:
    """Every stage under root, in pipeline order (SFT, RM, PPO, eval), then by path."""
    used: set[str] = set()
    stages = [load_stage(p, root, used) for p in find_run_dirs(root)]
    return sorted(stages, key=lambda s: (KIND_ORDER[s.kind], s.label))


# ---------------------------------------------------------------- plotting


def new_figure(panels: int, width: float = 4.2, height: float = 3.0) -> tuple[Figure, list[Axes]]:
    """A Figure on an Agg canvas with `panels` axes, at most three per row."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cols = min(panels, 3)
    rows = -(-panels // cols)
    fig = Figure(figsize=(width * cols, height * rows), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(rows, cols, i + 1) for i in range(panels)]
    return fig, axes


def draw_series(ax: Axes, named: list[tuple[str, Series]]) -> None:
    """One axes: each series as a line, with markers when sparse (a final eval row is a
    single point and would be invisible as a line)."""
    for name, s in named:
        label = name if not s.nonfinite else f"{name} ({s.nonfinite} non-finite skipped)"
        marker = "o" if len(s.values) <= 30 else None
        points = sorted(zip(s.steps, s.values))  # a line must not jump back in steps
        steps, values = [p[0] for p in points], [p[1] for p in points]
        ax.plot(steps, values, marker=marker, markersize=3, linewidth=1.2, label=mpl_text(label))
    ax.set_title(mpl_text(named[0][0]), fontsize=10)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    if len(named) > 1 or named[0][1].nonfinite:
        ax.legend(fontsize=7)


def plot_panels(
    stage: Stage, stem: str, title: str, panels: Sequence[Sequence[str]], out: Path
) -> Plot | None:
    """One PNG of the given panels (lists of metric names); None when none has data."""
    kept = []
    for panel in panels:
        named = [(n, stage.series[n]) for n in panel if n in stage.series]
        if any(s.values or s.nonfinite for _, s in named):
            kept.append(named)
    if not kept:
        return None
    fig, axes = new_figure(len(kept))
    for ax, named in zip(axes, kept):
        draw_series(ax, named)
    fig.suptitle(mpl_text(f"{stage.label}: {title}"), fontsize=11)
    file = f"{stage.slug}_{stem}.png"
    fig.savefig(out / file, format="png")
    return Plot(file, title)


def other_panels(stage: Stage, grouped: set[str]) -> list[tuple[str]]:
    """Metrics no group shows, one panel each, when they change over the steps or were
    ever non-finite (a single eval row or a constant counter is clearer in the summary
    table; a metric gone NaN is exactly what a user looks for)."""
    names = []
    for name in sorted(stage.series):
        s = stage.series[name]
        if name in grouped or name.startswith(NOT_IN_OTHER):
            continue
        if s.nonfinite or (len(s.values) >= 2 and min(s.values) != max(s.values)):
            names.append((name,))
    return names[:MAX_OTHER_PANELS]


def router_panels(stage: Stage) -> list[tuple[str, ...]]:
    """The router metrics of routing replay (docs/moe.md), one panel per kind with a line
    per layer (router/<kind>/layer_<l>), then the sampler gap with and without replay;
    empty for a dense run."""
    panels: list[tuple[str, ...]] = []
    for kind in ROUTER_KINDS:
        prefix = f"router/{kind}/layer_"
        layers = [n for n in stage.series if n.startswith(prefix)]
        layers.sort(key=lambda n: int(n.removeprefix(prefix)))
        if layers:
            panels.append(tuple(layers))
    gaps = ("router/logprob_gap_replayed", "router/logprob_gap_unreplayed")
    flips = ("router/flip_rate", "router/update_flip_rate")
    return panels + [tuple(n for n in group if n in stage.series)
                     for group in (gaps, flips) if any(n in stage.series for n in group)]  # fmt: skip


def plot_metrics(stage: Stage, out: Path) -> list[Plot]:
    """Every panel group of the stage that has data, then the remaining metrics."""
    plots: list[Plot] = []
    grouped: set[str] = set()
    for stem, title, panels in PANEL_GROUPS:
        grouped.update(name for panel in panels for name in panel)
        plot = plot_panels(stage, stem, title, panels, out)
        if plot:
            plots.append(plot)
    routers = router_panels(stage)
    grouped.update(name for panel in routers for name in panel)
    plot = plot_panels(stage, "router", "Mixture-of-experts routers, per layer", routers, out)
    if plot:
        plots.append(plot)
    others = other_panels(stage, grouped)
    if others:
        plot = plot_panels(stage, "other", "Other metrics", others, out)
        assert plot is not None  # other_panels keeps only metrics with data
        plots.append(plot)
    return plots


def valid_histogram(row: dict) -> bool:
    """A distributions.jsonl row that can be drawn: bins+1 numeric edges for bins counts."""
    edges, counts = row.get("edges"), row.get("counts")
    if not isinstance(row.get("name"), str) or finite(row.get("step")) is None:
        return False
    if not isinstance(edges, list) or not isinstance(counts, list) or not counts:
        return False
    return len(edges) == len(counts) + 1 and all(finite(v) is not None for v in edges + counts)


def histograms_by_name(rows: list[dict]) -> dict[str, list[dict]]:
    """name -> its valid rows sorted by step (for one step, the last row logged wins)."""
    by_name: dict[str, dict] = {}
    for row in rows:
        if valid_histogram(row):
            by_name.setdefault(row["name"], {})[float(row["step"])] = row
    return {name: [steps[k] for k in sorted(steps)] for name, steps in sorted(by_name.items())}


def plot_histogram(stage: Stage, name: str, row: dict, out: Path) -> Plot:
    """The bar plot of one histogram row, with its median and mean marked."""
    fig, (ax,) = new_figure(1, width=5.0, height=3.2)
    edges = [float(e) for e in row["edges"]]
    widths = [b - a for a, b in zip(edges, edges[1:])]
    ax.bar(edges[:-1], row["counts"], width=widths, align="edge", edgecolor="white", alpha=0.85)
    median = finite((row.get("quantiles") or {}).get("p50"))
    mean = finite(row.get("mean"))
    if median is not None:
        ax.axvline(median, color="black", linestyle="--", linewidth=1, label="p50")
    if mean is not None:
        ax.axvline(mean, color="tab:red", linewidth=1, label="mean")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    ax.set_title(mpl_text(f"{name} at step {row['step']:g} (n={row.get('n', '?')})"), fontsize=10)
    ax.set_ylabel("count", fontsize=8)
    ax.tick_params(labelsize=8)
    file = f"{stage.slug}_hist_{safe_name(name)}.png"
    fig.savefig(out / file, format="png")
    return Plot(file, f"{name}: latest histogram (step {row['step']:g})")


def quantile_rows(rows: list[dict]) -> list[tuple[float, dict]]:
    """(step, {p..: value}) of the rows whose p05, p50 and p95 are all finite numbers."""
    kept = []
    for row in rows:
        q = {k: finite(v) for k, v in (row.get("quantiles") or {}).items()}
        if all(q.get(k) is not None for k in ("p05", "p50", "p95")):
            kept.append((float(row["step"]), q))
    return kept


def plot_quantile_bands(stage: Stage, name: str, rows: list[dict], out: Path) -> Plot | None:
    """p05-p95 (and p25-p75 where logged) bands and the median over steps; None with
    fewer than two steps, where a band says nothing the histogram does not."""
    kept = quantile_rows(rows)
    if len(kept) < 2:
        return None
    fig, (ax,) = new_figure(1, width=5.0, height=3.2)
    steps = [s for s, _ in kept]
    ax.fill_between(
        steps, [q["p05"] for _, q in kept], [q["p95"] for _, q in kept], alpha=0.2, label="p05-p95"
    )
    if all(q.get("p25") is not None and q.get("p75") is not None for _, q in kept):
        ax.fill_between(
            steps,
            [q["p25"] for _, q in kept],
            [q["p75"] for _, q in kept],
            alpha=0.35,
            color="tab:blue",
            label="p25-p75",
        )
    ax.plot(
        steps, [q["p50"] for _, q in kept], marker="o", markersize=3, color="black", label="p50"
    )
    ax.set_title(mpl_text(f"{name}: quantiles over steps"), fontsize=10)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    file = f"{stage.slug}_quantiles_{safe_name(name)}.png"
    fig.savefig(out / file, format="png")
    return Plot(file, f"{name}: p05 / p50 / p95 over steps")


def plot_distributions(stage: Stage, out: Path) -> list[Plot]:
    """For each distribution name: the latest step's histogram, then its quantile bands."""
    plots = []
    for name, rows in histograms_by_name(stage.distributions).items():
        plots.append(plot_histogram(stage, name, rows[-1], out))
        band = plot_quantile_bands(stage, name, rows, out)
        if band:
            plots.append(band)
    return plots


def mpl_text(text: str) -> str:
    """Text for a matplotlib title or label: a "$" in a directory or metric name would
    otherwise start mathtext, which raises on anything that is not valid TeX."""
    return text.replace("$", r"\$")


def safe_name(name: str) -> str:
    """A file-name-safe form of a distribution name (names come from the run's files)."""
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_") or "unnamed"


# ---------------------------------------------------------------- HTML

CSS = """
body { font-family: sans-serif; margin: 1.5em auto; padding: 0 1em; max-width: 1400px; color: #222; }
h2 { border-bottom: 1px solid #ccc; padding-bottom: .2em; margin-top: 2em; }
table { border-collapse: collapse; margin: .5em 0 1em; font-size: 0.9em; }
th, td { border: 1px solid #ddd; padding: .25em .5em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
td.text { white-space: pre-wrap; max-width: 40em; }
figure { display: inline-block; margin: .5em; vertical-align: top; }
figure img { max-width: 100%; border: 1px solid #eee; }
.alerts td { background: #fff4e5; }
.note { color: #666; font-size: 0.9em; }
"""


def esc(value: Any) -> str:
    """Escaped text of any value; floats to 4 significant digits."""
    if isinstance(value, float):
        return html.escape(f"{value:.4g}")
    if isinstance(value, (dict, list)):
        value = json.dumps(value)
    return html.escape(str(value))


def flatten(tree: dict, prefix: str = "") -> dict:
    """{"ppo.score": ...} from nested dicts (the demo's summary.json nests by stage)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat |= flatten(value, name + ".")
        else:
            flat[name] = value
    return flat


def summary_table(summary: dict) -> str:
    """A two-column key/value table of a summary.json."""
    rows = "".join(
        f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in flatten(summary).items()
    )
    return f"<table class='summary'>{rows}</table>"


def records_table(rows: list[dict], columns: list[str], css: str = "") -> str:
    """A table of dict rows; prompt/response/message cells keep their line breaks."""
    head = "".join(f"<th>{esc(c)}</th>" for c in columns)
    body = ""
    for row in rows:
        cells = "".join(
            f"<td class='text'>{esc(row.get(c, ''))}</td>"
            if c in ("prompt", "response", "message")
            else f"<td>{esc(row.get(c, ''))}</td>"
            for c in columns
        )
        body += f"<tr>{cells}</tr>"
    return f"<table class='{css}'><tr>{head}</tr>{body}</table>"


def samples_html(samples: list[dict]) -> str:
    """The latest MAX_SAMPLES samples, latest step first (rows without a step, as in an
    eval directory, keep their file order)."""
    if not samples:
        return ""

    def step(row: dict) -> float:
        s = finite(row.get("step"))
        return -s if s is not None else math.inf

    ordered = sorted(samples, key=step)[:MAX_SAMPLES]  # stable: file order within a step
    known = ["step", "prompt", "prompt_index", "response", "score", "kl"]
    present = {k for row in ordered for k in row}
    columns = [c for c in known if c in present] + sorted(present - set(known))
    note = f"<p class='note'>{len(ordered)} of {len(samples)} samples.</p>"
    return "<h3>Samples</h3>" + note + records_table(ordered, columns, "samples")


def figures_html(plots: list[Plot]) -> str:
    """<figure>s with relative links to the PNGs (they sit next to index.html); each PNG
    carries its own title, the caption is the alt text."""
    return "".join(
        f"<figure><img src='{html.escape(p.file, quote=True)}' alt='{esc(p.caption)}'></figure>"
        for p in plots
    )


def stage_html(stage: Stage, curves: list[Plot], dists: list[Plot]) -> str:
    """One stage's section: summary, alerts, curves, distributions, samples."""
    parts = [
        f"<section id='{esc(stage.slug)}'><h2>{esc(KIND_TITLE[stage.kind])}: {esc(stage.label)}</h2>"
    ]
    parts.append(f"<p class='note'>{esc(stage.path)}</p>")
    if stage.summary:
        parts.append("<h3>Summary</h3>" + summary_table(stage.summary))
    if stage.alerts:
        parts.append(
            "<h3>Alerts</h3>" + records_table(stage.alerts, ["step", "name", "message"], "alerts")
        )
    if curves:
        parts.append("<h3>Curves</h3>" + figures_html(curves))
    if dists:
        parts.append("<h3>Distributions</h3>" + figures_html(dists))
    parts.append(samples_html(stage.samples))
    return "".join(parts) + "</section>"


def page_html(root: Path, top_summary: dict | None, sections: list[tuple[Stage, str]]) -> str:
    """The whole page: the top-level summary (the demo's), a table of contents, stages."""
    title = f"rlhf_dist report: {root.resolve().name}"
    toc = "".join(
        f"<li><a href='#{esc(s.slug)}'>{esc(KIND_TITLE[s.kind])}: {esc(s.label)}</a></li>"
        for s, _ in sections
    )
    head = f"<h1>{esc(title)}</h1><p class='note'>{esc(root.resolve())}</p>"
    if top_summary:
        head += "<h2>Summary</h2>" + summary_table(top_summary)
    body = head + f"<ul>{toc}</ul>" + "".join(part for _, part in sections)
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>{esc(title)}</title><style>{CSS}</style></head>\n<body>{body}</body></html>\n"
    )


def build_report(path: str | Path, output: str | Path | None = None) -> Path:
    """Write PATH/report/index.html (or OUTPUT/index.html) and its PNGs; returns the
    page's path. Raises ConfigError when neither PATH nor a directory up to two levels
    below it holds a metrics.jsonl."""
    root = Path(path)
    stages = load_stages(root)
    out = Path(output) if output is not None else root / "report"
    out.mkdir(parents=True, exist_ok=True)
    sections = []
    for stage in stages:
        curves, dists = plot_metrics(stage, out), plot_distributions(stage, out)
        sections.append((stage, stage_html(stage, curves, dists)))
    # A directory of runs (the demo's) has its own summary.json; a single run's is shown
    # in its section already.
    top = read_json(root / "summary.json") if stages[0].path != root else None
    index = out / "index.html"
    index.write_text(page_html(root, top, sections), encoding="utf-8")
    return index
