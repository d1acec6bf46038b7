"""Multi-turn rollouts under 2-rank ZeRO-3 with ranks running different numbers of turns
(docs/agents.md, "Distribution"): episodes end after 1 turn on rank 0 and 3 turns on
rank 1, with generation's forwards gathering layers with collectives
(perf.gather_for_generation=false). Rank 0 must run throw-away turns in lock-step;
a hang fails the launch at distributed.timeout_s."""

from __future__ import annotations

import json
import os

from conftest import REPO, free_port, launch_args, ppo_command, run_launch

SCRIPTS = REPO / "tests" / "distributed" / "scripts"
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_uneven_turns_under_zero3_stay_in_lock_step(assets, tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE, encoding="utf-8")
    out = tmp_path / "ppo"
    # Every token stops a turn: each turn is one sampled token, so the episodes' lengths
    # are the environment's alone.
    every_token = "[" + ",".join(str(i) for i in range(102)) + "]"
    extra = [
        "ppo.estimator=grpo", "ppo.samples_per_prompt=2", "ppo.rollout_batch_size=4",
        "ppo.rollout_micro_batch_size=4", "ppo.minibatch_size=8", "ppo.micro_batch_size=4",
        "ppo.iterations=1", "reward.function=rlhf_dist.demo.task:positive_word_reward",
        "generation.environment=uneven_turns_env:make", "generation.max_turns=4",
        f"generation.stop_token_ids={every_token}", f"data.chat_template={template}",
        "perf.gather_for_generation=false", "distributed.timeout_s=120",
    ]  # fmt: skip
    command = launch_args("cpu_zero3.yaml", free_port(), *ppo_command(assets, out, *extra))
    path = os.pathsep.join([str(SCRIPTS), str(REPO), os.environ.get("PYTHONPATH", "")])
    run_launch(command, timeout=300, env={"PYTHONPATH": path})
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert row["rollout/turns"] == 2.0  # 4 episodes x 1 turn (rank 0), 4 x 3 (rank 1)
    assert row["rollout/truncated_episodes"] == 0.0
    assert row["rollout/sequences"] == 8
