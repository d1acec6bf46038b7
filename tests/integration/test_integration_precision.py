"""bf16 without DeepSpeed keeps fp32 master weights: a small learning rate still moves the
weights (bf16 weights would round most Adam steps of ~lr away), and final/ is bf16."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from rlhf_dist.models import trained_load_dtype, upcast_trainable

REPO = Path(__file__).resolve().parents[2]


def test_load_dtype_table():
    # (asked dtype, DeepSpeed, frozen LoRA base) -> dtype the trained model is loaded in
    assert trained_load_dtype("bfloat16", deepspeed=False, frozen_base=False) == "float32"
    assert trained_load_dtype("bfloat16", deepspeed=True, frozen_base=False) == "bfloat16"
    assert trained_load_dtype("bfloat16", deepspeed=False, frozen_base=True) == "bfloat16"
    assert trained_load_dtype("float32", deepspeed=False, frozen_base=True) == "float32"


def test_upcast_trainable_leaves_frozen_weights_alone():
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)).to(torch.bfloat16)
    net[0].requires_grad_(False)
    upcast_trainable(net)
    assert net[0].weight.dtype == torch.bfloat16 and net[1].weight.dtype == torch.float32


@pytest.mark.slow
def test_bf16_ppo_at_small_lr_moves_most_actor_weights(sft_run, rm_run, task_env, tmp_path):
    out = tmp_path / "ppo"
    args = [
        sys.executable, "-m", "rlhf_dist", "ppo",
        f"model.policy={sft_run.out / 'final'}", f"model.reward={rm_run.out / 'final'}",
        "model.dtype=bfloat16", f"data.train={task_env.prompts}", f"run.output_dir={out}",
        "data.max_prompt_length=16", "ppo.iterations=3", "ppo.rollout_batch_size=8",
        "ppo.rollout_micro_batch_size=8", "ppo.minibatch_size=4", "ppo.micro_batch_size=4",
        "ppo.optim.lr=3e-6", "ppo.critic_optim.lr=3e-6", "generation.max_new_tokens=8",
        "run.checkpoint_every=1", "run.keep_checkpoints=3", "run.progress=false",
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Compare the weights after iteration 1 with those after iteration 3 (comparing with
    # the fp32 SFT weights would count the rounding of a bf16 load as movement).
    ckpts = out / "checkpoints"
    first = torch.load(ckpts / "step-000001/training.pt", weights_only=True)["params"]
    last = torch.load(ckpts / "step-000003/training.pt", weights_only=True)["params"]
    moved = total = 0
    for name, value in last.items():
        if not name.startswith("actor.") or "embed_tokens" in name:
            continue
        moved += int((value != first[name]).sum())
        total += value.numel()
    assert total > 0
    assert moved / total >= 0.9, f"only {moved / total:.1%} of the actor's weights moved"
    with safe_open(str(out / "final/model.safetensors"), "pt") as f:
        dtypes = {f.get_tensor(k).dtype for k in f.keys()}  # noqa: SIM118
    assert dtypes == {torch.bfloat16}  # exported in the precision asked for
    assert json.loads((out / "summary.json").read_text())["iterations"] == 3
