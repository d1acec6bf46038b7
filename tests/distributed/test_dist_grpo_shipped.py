"""The shipped launch/configs/grpo_zero3_8gpu.yaml as written (ZeRO-3, vLLM rollouts, the
grpo preset's 8 samples per prompt, rollout_correction=tis, gradient checkpointing), launched as its
header says on 2 CPU ranks (gloo) with the real SmolLM2-135M-Instruct, a reward function
that reads the row's `answer` column and the file's keys overridden only where a CPU here
cannot run them as written: the model, data and reward (placeholders in the file),
fp32 (bf16 is the GPU's), 8 new tokens, vLLM's CPU KV cache, one iteration of one prompt
per rank, no wandb and a temporary output directory. Under ZeRO-3 as shipped, and (opt-in,
docs/distributed.md "Which 2-rank tests run under both engines") the same file launched with
cpu_fsdp2.yaml, as a user switching engines would.

Skipped where vllm is not installed (launch/setup.sh installs it on CPU machines)."""

from __future__ import annotations

import json
import os

import pytest
from conftest import ENGINES, REPO, engines, free_port, launch_args, run_launch
from safetensors import safe_open

pytest.importorskip("vllm")

CONFIG = REPO / "launch" / "configs" / "grpo_zero3_8gpu.yaml"
PROBE = "model.layers.29.mlp.down_proj.weight"
QUESTIONS = [(2, 3), (4, 4), (1, 6), (5, 4), (3, 3), (7, 3)]
# The user's reward module (on PYTHONPATH: the launcher's working directory is the
# repository). Each rank records what its calls were given in calls.<rank>.jsonl.
REWARDS = """
import json
import os


def accuracy(prompts, completions, answer, **kwargs):
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    scores = [float(a in t) - 0.001 * len(t) for t, a in zip(texts, answer)]
    path = os.path.join(os.path.dirname(__file__), f"calls.{os.environ['RANK']}.jsonl")
    with open(path, "a", encoding="utf-8") as f:
        for p, a, s in zip(prompts, answer, scores):
            f.write(json.dumps({"prompt": p, "answer": a, "score": s}) + "\\n")
    return scores
"""


def _probe(model_dir):
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return f.get_tensor(PROBE)


def _jsonl(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x]


@pytest.mark.slow
@pytest.mark.parametrize("engine", engines())
def test_shipped_grpo_vllm_config_trains_on_two_cpu_ranks(smollm2, engine, tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    (user / "answer_rewards.py").write_text(REWARDS)
    rows = [
        {"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}
        for a, b in QUESTIONS
    ]
    (user / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    base, out = smollm2["shipped"], tmp_path / "grpo"
    command = [
        "-m", "rlhf_dist", "grpo", "--config", str(CONFIG),
        f"model.policy={base}", "model.dtype=float32",
        f"data.train={user / 'prompts.jsonl'}", "reward.function=answer_rewards:accuracy",
        "generation.max_new_tokens=8",
        "generation.vllm_kv_cache_gib=0.25",
        "ppo.iterations=1", "ppo.rollout_batch_size=2", "run.trackers=[]",
        # the resume tests cover checkpoints; the file's checkpoint_every=50 would write one
        # at this last iteration: 1.6 GB of weights and Adam moments, ~20 s here
        "run.checkpoint_every=0",
        f"run.output_dir={out}",
    ]  # fmt: skip
    path = os.pathsep.join([str(REPO), str(user)])
    proc = run_launch(
        launch_args(ENGINES[engine], free_port(), *command), timeout=420,
        env={"PYTHONPATH": path},
    )  # fmt: skip
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    (metrics,) = _jsonl(out / "metrics.jsonl")
    assert metrics["step"] == 1 and metrics["guard/skipped_steps"] == 0
    assert metrics["rollout/sequences"] == 16  # 2 prompts x the preset's 8 samples
    assert metrics["rollout/sampler_logprob_absdiff"] < 1e-4  # fp32: vLLM samples pi_old
    # each rank scored its own prompt's 8 samples, each with that prompt's answer
    answers = {json.dumps(r["prompt"]): r["answer"] for r in rows}
    calls = [_jsonl(user / f"calls.{rank}.jsonl") for rank in (0, 1)]
    prompts = [{json.dumps(c["prompt"]) for c in rank_calls} for rank_calls in calls]
    assert [len(c) for c in calls] == [8, 8] and [len(p) for p in prompts] == [1, 1]
    assert prompts[0] != prompts[1]
    assert all(c["answer"] == answers[json.dumps(c["prompt"])] for c in calls[0] + calls[1])
    scores = [c["score"] for c in calls[0] + calls[1]]
    assert metrics["objective/raw_score"] == pytest.approx(sum(scores) / 16, abs=1e-5)
    assert not (_probe(out / "final") == _probe(base)).all(), "the actor did not train"
    effective = (out / "config.yaml").read_text()
    assert "gradient_checkpointing: true" in effective and "rollout_correction: tis" in effective
