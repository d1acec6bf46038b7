"""run.auto_fit under a memory cap it did not choose (docs/distributed.md, "Planning memory").

A memory cgroup caps a GRPO run of the planner grid's largest model at its longest
response (launch/bench/memory.py plan: "L", 384 hidden x 6 layers, a 12,288-token
vocabulary, 128 new tokens), 32 sequences per rollout. At the configured sizes (every
sequence in one forward and one micro-batch) the run needs more than the cap and is
killed for memory: the cap binds. With run.auto_fit=true the plan at the start reads the
cap (the cgroup's limit less what the process already holds: distributed/backend.py,
host_memory_budget), takes the largest micro-batches whose plan fits, and the same run
finishes.

Needs a memory cgroup it may create (root; cgroup v1 or v2 with the memory controller);
skipped, with the reason, where there is none.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CAP = 1400 * 2**20  # measured: ~1.05 GiB peak at micro-batches of 4, ~1.7 GiB at 32 (no cap)
ROWS = 32  # 8 prompts x 4 samples: one rollout, one optimizer step


def memory_controller() -> tuple[Path, str, str] | None:
    """(where to create a cgroup, its limit file, its swap-limit file) or None."""
    v1 = Path("/sys/fs/cgroup/memory")
    if (v1 / "cgroup.procs").exists() and os.access(v1, os.W_OK):
        return v1, "memory.limit_in_bytes", "memory.memsw.limit_in_bytes"
    v2 = Path("/sys/fs/cgroup")
    control = v2 / "cgroup.subtree_control"
    if control.exists() and "memory" in control.read_text().split() and os.access(v2, os.W_OK):
        return v2, "memory.max", "memory.swap.max"
    return None


@contextmanager
def memory_cgroup(limit: int):
    """A new cgroup whose memory (and memory + swap, where swap is limited separately)
    is capped at `limit` bytes; removed afterwards."""
    found = memory_controller()
    if found is None:
        pytest.skip("no writable memory cgroup here (needs root and the memory controller)")
    root, limit_file, swap_file = found
    group = root / f"rlhf_dist_test_{os.getpid()}_{time.monotonic_ns()}"
    try:
        group.mkdir()
    except OSError as e:
        pytest.skip(f"cannot create a memory cgroup here: {e}")
    try:
        (group / limit_file).write_text(str(limit))
        if (group / swap_file).exists():  # no swapping past the cap instead of dying
            (group / swap_file).write_text(str(limit) if "memsw" in swap_file else "0")
        yield group
    finally:
        for _ in range(100):  # the killed process leaves the group a moment later
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def build_largest_cell(task_env, out: Path) -> Path:
    """The grid's "L" Llama (random init, fp32) saved with the demo's tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = task_env.tokenizer
    config = LlamaConfig(
        vocab_size=12288, hidden_size=384, num_hidden_layers=6, num_attention_heads=6,
        num_key_value_heads=2, intermediate_size=1024, max_position_embeddings=1024,
        tie_word_embeddings=False, pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


def grpo_in(group: Path, policy: Path, prompts: Path, out: Path, *extra: str):
    def enter_the_cgroup():  # runs in the child before it executes Python
        (group / "cgroup.procs").write_text(str(os.getpid()))

    args = [
        sys.executable, "-m", "rlhf_dist", "grpo", f"model.policy={policy}",
        f"data.train={prompts}", "reward.function=rlhf_dist.demo.task:gold_reward_fn",
        f"run.output_dir={out}", "run.progress=false", "run.checkpoint_every=0",
        "perf.num_threads=1", "ppo.iterations=1", "ppo.samples_per_prompt=4",
        f"ppo.rollout_batch_size={ROWS // 4}", "generation.max_new_tokens=128",
        "generation.min_new_tokens=128", *extra,
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run(
        args, cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
        preexec_fn=enter_the_cgroup,
    )  # fmt: skip


@pytest.mark.slow
def test_auto_fit_runs_the_largest_cell_under_a_memory_cap_that_kills_it_otherwise(
    task_env, tmp_path
):
    policy = build_largest_cell(task_env, tmp_path / "L")
    prompts = task_env.files.prompts
    configured = (f"ppo.rollout_micro_batch_size={ROWS}", f"ppo.micro_batch_size={ROWS}")
    with memory_cgroup(CAP) as group:
        killed = grpo_in(group, policy, prompts, tmp_path / "configured", *configured)
        fitted = grpo_in(group, policy, prompts, tmp_path / "fitted", *configured,
                         "run.auto_fit=true")  # fmt: skip
    assert killed.returncode == -9, (killed.returncode, killed.stderr[-2000:])
    assert fitted.returncode == 0, fitted.stderr[-3000:]
    (line,) = [x for x in fitted.stdout.splitlines() if "run.auto_fit:" in x]
    chosen = dict(kv.split("=") for kv in line.split("run.auto_fit:")[1].split())
    assert 1 <= int(chosen["ppo.micro_batch_size"]) < ROWS, line
    assert (tmp_path / "fitted" / "final" / "model.safetensors").is_file()
