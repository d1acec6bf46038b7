"""A rank that fails alone ends the whole launch at once, not after distributed.timeout_s.

RLHF_DIST_FAULT=crash:rollout:1@1 raises on rank 1 after its first rollout, while rank 0
goes on to the next collective (a bug or a host-side error that one rank hits). Rank 1
must leave without the closing barrier (api.close, cli.entry) so its launcher stops rank
0; with the barrier both ranks waited for distributed.timeout_s (30 minutes by default).
"""

from __future__ import annotations

from conftest import free_port, launch_args, ppo_command, run_all


def test_one_rank_crashing_ends_the_launch_at_once(assets, tmp_path):
    command = launch_args("cpu_zero3.yaml", free_port(), *ppo_command(assets, tmp_path / "ppo"))
    # A launch still running after 120 s fails here, with every rank's stack.
    ((returncode, out, err),) = run_all([command], 120, [{"RLHF_DIST_FAULT": "crash:rollout:1@1"}])
    output = out + err
    assert returncode != 0, output[-3000:]
    assert "injected crash (RLHF_DIST_FAULT=crash:rollout:1@1)" in output, output[-3000:]
    # Rank 0 is stopped by the launcher, or sees rank 1's connection close ("lost contact"),
    # at once: not by a collective's timeout (distributed.timeout_s: 1800 s).
    assert "Timed out" not in output, output[-3000:]
