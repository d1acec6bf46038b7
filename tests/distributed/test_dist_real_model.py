"""The real chat tokenizer as it ships (SmolLM2-135M-Instruct's: PAD == EOS, ChatML, a
49,152-token vocabulary) under 2-rank ZeRO-3: GRPO on message-list prompts with a reward
function trains, keeps the ranks in step (the PAD ids around prompts and after finished
responses are EOS ids; only masks tell them apart), and exports the actor with the
tokenizer as shipped. The weights are a tiny random Llama carrying that tokenizer: what
this checks is the data path across ranks, which the real weights would only slow down
(the real weights under 2-rank ZeRO-3: test_dist_grpo_shipped.py).
"""

from __future__ import annotations

import json
import os

import pytest
from conftest import REPO, free_port, launch_args, run_launch
from safetensors import safe_open

PROBE = "model.layers.1.mlp.down_proj.weight"  # the tiny Llama's last layer


def _probe(model_dir):
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return f.get_tensor(PROBE)


@pytest.mark.slow
def test_grpo_with_the_real_tokenizer_pad_equal_to_eos_under_zero3(smollm2, chat_files, tmp_path):
    from transformers import AutoTokenizer

    from rlhf_dist.demo import task

    shipped = AutoTokenizer.from_pretrained(str(smollm2["shipped"]))
    base = task.build_tiny_models(tmp_path / "tiny", shipped, size="tiny", seed=0)["policy"]
    out = tmp_path / "grpo"
    command = [
        "-m", "rlhf_dist", "ppo",
        # Words per response: samples of 10 tokens differ in it, so a group has spread and
        # GRPO a gradient (the demo's gold reward is 0 for nearly all of them: ties).
        f"model.policy={base}", "reward.function=reward_fns_for_tests:length_reward",
        f"data.train={chat_files['prompts']}", f"run.output_dir={out}",
        "run.log_every=1", "perf.num_threads=1", "distributed.timeout_s=240",
        "data.max_length=96", "data.max_prompt_length=56",
        "ppo.estimator=grpo", "ppo.iterations=1", "ppo.samples_per_prompt=2",
        "ppo.rollout_batch_size=2", "ppo.rollout_micro_batch_size=2", "ppo.minibatch_size=4",
        "ppo.micro_batch_size=2", "ppo.ppo_epochs=1", "ppo.optim.lr=1e-5",
        "generation.max_new_tokens=10", "generation.temperature=1.0",
    ]  # fmt: skip
    path = os.pathsep.join([str(REPO), str(REPO / "tests" / "unit")])  # the reward's module
    run_launch(
        launch_args("cpu_zero3.yaml", free_port(), *command), timeout=420,
        env={"PYTHONPATH": path},
    )  # fmt: skip
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    assert len(rows) == 1 and rows[0]["guard/skipped_steps"] == 0
    lengths = (
        [
            json.loads(x)["response_length"]
            for x in (out / "samples.jsonl").read_text().splitlines()
            if x
        ]
        if (out / "samples.jsonl").exists()
        else []
    )
    assert all(0 < n <= 10 for n in lengths)
    assert not (_probe(out / "final") == _probe(base)).all(), "the actor did not train"
    exported = AutoTokenizer.from_pretrained(str(out / "final"))
    assert exported.pad_token_id == shipped.pad_token_id == shipped.eos_token_id
