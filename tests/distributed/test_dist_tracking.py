"""Trackers through Accelerate: an offline W&B run and a TensorBoard event file hold the
documented scalars and the histograms; distributions/samples/alerts land as JSON lines."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO, _env


def test_wandb_offline_and_tensorboard_hold_scalars_and_histograms(assets, tmp_path):
    out = tmp_path / "ppo"
    args = [
        "ppo", f"model.policy={assets['policy']}", f"model.reward={assets['reward']}",
        f"data.train={assets['files'].prompts}", f"run.output_dir={out}", "ppo.iterations=2",
        "ppo.rollout_batch_size=8", "ppo.minibatch_size=8", "ppo.micro_batch_size=8",
        "generation.max_new_tokens=8", "run.histogram_every=1", "run.samples_every=1",
        "run.trackers=[wandb,tensorboard]", "run.wandb_mode=offline",
    ]  # fmt: skip
    env = _env() | {"WANDB_SILENT": "true", "WANDB_API_KEY": "", "WANDB_MODE": "offline"}
    proc = subprocess.run(
        [sys.executable, "-m", "rlhf_dist", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    documented = [
        "objective/score",
        "objective/kl",
        "policy/clipfrac",
        "value/explained_variance",
        "rollout/length",
        "time/total",
        "throughput/samples_per_s",
        "memory/peak_gib",
    ]
    # W&B offline: the run's record log holds every logged key, the histograms and the table.
    (record,) = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    blob = record.read_bytes()
    for key in [
        *documented,
        "dist/advantages",
        "dist/kl",
        "dist/scores",
        "dist/length",
        "histogram",
        "samples",
    ]:
        assert key.encode() in blob, key
    # TensorBoard: scalars and histograms, read back with TensorBoard's own reader.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "rlhf_dist"), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    tags = events.Tags()
    assert set(documented) <= set(tags["scalars"])
    assert {"dist/advantages", "dist/kl", "dist/scores", "dist/length"} <= set(tags["histograms"])
    # JSON lines: quantiles in the metrics rows, histograms and samples per iteration.
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all("dist/kl/p50" in r for r in rows)
    hists = [json.loads(line) for line in (out / "distributions.jsonl").read_text().splitlines()]
    assert {(h["step"], h["name"]) for h in hists} == {
        (s, n) for s in (1, 2) for n in ("advantages", "kl", "scores", "length")
    }
    assert all(sum(h["counts"]) == h["n"] for h in hists)
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and set(samples[0]) == {
        "step",
        "prompt",
        "prompt_index",
        "response",
        "score",
        "kl",
        "length",
    }
