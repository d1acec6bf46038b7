"""PPO across 2 CPU ranks under ZeRO-3 or FSDP2 with its rollouts from a `rlhf-dist serve`
process (generation.backend=server, docs/serving.md), launched like a user would: both
ranks sample through the server, the actor stays partitioned while rank 0 sends it in
buckets of 50 KiB (each gathered on its own, by both ranks), and the post-sync check after
every sync passes only if the served weights are the trained ones. Which engine variants
run in CI: docs/distributed.md "Which 2-rank tests run under both engines"."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import ENGINES, REPO, engines, free_port, launch_args, ppo_command, run_launch
from faults import untimed
from safetensors.torch import load_file
from serve_process import served

ENV, TOKEN = "RLHF_DIST_TEST_SERVER_TOKEN", "dist-test-token-51f0"
RUN_STAGES = str(REPO / "tests" / "distributed" / "scripts" / "run_stages.py")


def served_ppo(
    assets,
    out: Path,
    engine: str,
    *extra: str,
    serve: dict | None = None,
    server_env: dict | None = None,
    then: list[str] | None = None,
) -> dict:
    """2-rank PPO under `engine` (conftest.ppo_command + `extra`) against a fresh server of
    the tiny policy (`serve`: its serve keys; `server_env`: added to its environment),
    synced in 50 KiB buckets -> the server's /health at the end. `then`, another
    `-m rlhf_dist STAGE ...` command, runs after it in the same launch (scripts/
    run_stages.py: one process per rank for both, one round of imports)."""
    tree = {"model": {"policy": str(assets["policy"])}, "perf": {"num_threads": 1},
            "serve": serve or {}}  # fmt: skip
    with served(tree, ENV, TOKEN, server_env=server_env) as url:
        command = ppo_command(
            assets, out, "generation.backend=server", f"generation.server_urls=[{url}]",
            f"generation.server_token_env={ENV}", "generation.server_sync_bucket_mb=0.05",
            "distributed.timeout_s=60", *extra,
        )  # fmt: skip
        timeout = 240
        if then is not None:  # run_stages.py takes each command from its stage name on
            command, timeout = [RUN_STAGES, json.dumps([command[2:], then[2:]])], 360
        run_launch(
            launch_args(ENGINES[engine], free_port(), *command), timeout=timeout, env={ENV: TOKEN}
        )
        with urllib.request.urlopen(url + "/health", timeout=10) as answer:
            return json.loads(answer.read())


@pytest.mark.parametrize("engine", engines())
def test_ppo_two_ranks_with_rollouts_from_a_server(assets, engine, tmp_path):
    """Each rank's /generate after a sync: with serve.batch_window_ms the two ranks'
    requests are merged into one generate call (the window is wide for a loaded CI
    machine), each rank's rows sampled as its own request's. Every rank knows the synced
    version from rank 0, not from a server still applying the update."""
    out = tmp_path / "served"
    # The second update applies 1 s after its broadcast ends: rank 1 must still stamp its
    # request with version 2 (it once read the server's /health, which showed 1 then).
    slow = {"RLHF_DIST_FAULT": "slow_update:2"}
    health = served_ppo(assets, out, engine, serve={"batch_window_ms": 2000}, server_env=slow)
    assert health["version"] == 2  # one sync per rollout
    assert health["batched"]["requests"] == 4  # 2 ranks x 2 rollouts
    assert health["batched"]["batches"] < 4  # merged, at least once
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout/sequences"] == 16  # both ranks' 8 prompts, served
        assert r["rollout/sampler_logprob_absdiff"] < 1e-4  # fp32: the server samples pi_old
    before = load_file(str(Path(assets["policy"]) / "model.safetensors"))
    after = load_file(str(out / "final" / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("engine", engines())
def test_greedy_served_rollouts_give_the_colocated_runs_metrics(assets, engine, tmp_path):
    """ppo.max_staleness=0 against a server = colocated generation, 2 ranks under `engine`,
    at the same seed. The two paths draw from the trainer's RNG differently (the server
    path draws request seeds; colocated sampling continues the RNG), so what the RNG
    decides is taken out of the comparison: every token by top_k=1, and the minibatch
    shuffle by one minibatch per iteration (its token-mean loss does not depend on how the
    rows fall into micro-batches). Both runs then sample the same tokens from the same
    weights and take the same steps: every logged metric of the two PPO iterations agrees
    within 1e-4 (relative; two code paths, so not bitwise), machine timings, the server's
    own figures and the micro-batches' padding aside."""
    served_out, colocated_out = tmp_path / "served", tmp_path / "colocated"
    same = ("generation.top_k=1", "ppo.minibatch_size=16")
    # the colocated run in the served run's launch, after it (each stage seeded afresh)
    served_ppo(assets, served_out, engine, *same, then=ppo_command(assets, colocated_out, *same))
    served_rows, colocated_rows = (
        untimed([json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()])
        for out in (served_out, colocated_out)
    )
    assert len(served_rows) == len(colocated_rows) == 2
    for served_row, colocated_row in zip(served_rows, colocated_rows):
        assert set(colocated_row) <= set(served_row)  # the server adds its own figures
        for key, value in colocated_row.items():
            if key == "update/pad_fraction":  # which rows share a micro-batch: shuffled
                continue
            assert served_row[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


# FSDP2 in CI: the sync reads the actor's weights a bucket at a time from its shards
# (whole base, then adapters), a path of each engine's own (weight_sync.whole_bucket).
@pytest.mark.parametrize("engine", engines("fsdp2"))
def test_lora_two_ranks_syncs_the_adapters_the_server_folds_in(assets, engine, tmp_path):
    """lora.enabled, 2 ranks under `engine`: the adapters are partitioned like every weight;
    the first sync sends the base whole and the adapters, later ones the adapters only,
    each gathered a bucket at a time; the served policy stays the trainer's adapted actor
    (post-sync check and sampler log-probs within fp32 rounding)."""
    out = tmp_path / "lora"
    health = served_ppo(assets, out, engine, "lora.enabled=true", "lora.r=4", "ppo.iterations=3")
    assert health["version"] == 3
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rollout/server_sync_gap"] < 1e-4 for r in rows)
    assert all(r["rollout/sampler_logprob_absdiff"] < 1e-4 for r in rows)
