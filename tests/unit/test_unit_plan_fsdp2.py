"""The memory planner's FSDP2 terms (rlhf_dist/planning, Hardware.fsdp2): hand-computed
model states and gathered units, properties over ranks, and `rlhf-dist plan --engine
fsdp2`."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_dist.config import load_config
from rlhf_dist.errors import ConfigError
from rlhf_dist.planning import GIB, Hardware, ModelShape, Shapes, build_plan
from rlhf_dist.planning import memory as mem
from rlhf_dist.planning.advice import hardware, launch_steps
from rlhf_dist.planning.shapes import read_shape

ROOT = Path(__file__).resolve().parents[2]
SHAPES = ROOT / "launch/configs/shapes"
# 152 weights per layer, embedding 40, final norm 4, head 40 (tests/unit/test_unit_plan.py)
TINY = ModelShape(vocab=10, hidden=4, layers=2, heads=2, kv_heads=1, head_dim=2, intermediate=8)


def _cfg(*overrides, preset=None):
    return load_config(None, [f"model.policy={SHAPES / 'llama3-8b'}", "data.train=x", *overrides], preset)  # fmt: skip


def _terms(plan, phase):
    return dict(next(p for p in plan.phases if p.name == phase).terms)


def test_fsdp2_states_by_hand():
    # fp32 shards of weights (4), gradients (4) and Adam's moments (8) over 4 ranks; a
    # frozen LoRA base's 400 fp32 bytes sharded too
    s = mem.fsdp2_states(1000, 400.0, world=4)
    assert (s.params, s.grads, s.optimizer, s.cpu) == (1100, 1000, 2000, 0)
    off = mem.fsdp2_states(1000, 400.0, world=4, offload="all")
    assert (off.params, off.grads, off.optimizer, off.cpu) == (0, 0, 0, 4100)


def test_fsdp2_gathered_units_by_hand():
    root = TINY.lm_params() - TINY.layers * TINY.layer_params()  # 40 + 4 + 40 = 84
    assert root == 84
    # bf16: root 84 + two layers of 152, 2 bytes; backward adds one layer's bf16 and fp32 grads
    assert mem.fsdp2_gathered(TINY, 2.0, root, training=False) == (84 + 2 * 152) * 2
    assert mem.fsdp2_gathered(TINY, 2.0, root, training=True) == (84 + 304) * 2 + 152 * 6


def test_the_root_units_first_all_gather_by_hand():
    # root 84 in bf16: its all-gather output and the unsharded copy, 2 x 84 x 2 = 336 bytes,
    # counted by how much it exceeds the pass's other transients
    assert mem.fsdp2_root_gather(84, 2.0, 300.0) == 36
    assert mem.fsdp2_root_gather(84, 2.0, 400.0) == 0


def test_sft_plan_under_fsdp2_by_hand():
    shape = read_shape(str(SHAPES / "llama3-8b"), "model.policy")
    n, layer = shape.lm_params(), shape.layer_params()
    hw = Hardware(8, 80 * GIB, fsdp2=True)
    # 8 rows per rank in micro-batches of 2: gradients exist through every pass but the first
    cfg = _cfg("model.dtype=bfloat16", "sft.batch_size=64", "sft.micro_batch_size=2")
    update = _terms(build_plan(cfg, "sft", Shapes(shape), hw), "update")
    assert update["weights"] == 4 * n / 8  # fp32 masters, sharded
    assert update["gradients"] == 4 * n / 8
    assert update["optimizer states"] == 8 * n / 8
    root = n - shape.layers * layer
    assert update["gathered units (FSDP2)"] == (root + 2 * layer) * 2 + layer * 6
    # no autocast copies, no ZeRO-3 buffers
    assert not any("autocast" in k or "ZeRO" in k for k in update)
    # one pass per step: set_to_none frees the sharded gradients between steps (unlike
    # ZeRO's partitions), so they count only as backward frees the activations
    one = _cfg("model.dtype=bfloat16", "sft.batch_size=64", "sft.micro_batch_size=8")
    single = _terms(build_plan(one, "sft", Shapes(shape), hw), "update")
    assert "gradients" not in single and "gradients (as activations are freed)" in single


@pytest.mark.parametrize("gather", [True, False])
def test_grpo_generation_under_fsdp2(gather):
    shape = read_shape(str(SHAPES / "llama3-8b"), "model.policy")
    cfg = _cfg("model.dtype=bfloat16", "reward.function=a:b", "generation.backend=hf",
               f"perf.gather_for_generation={str(gather).lower()}", preset="grpo")  # fmt: skip
    plan = build_plan(cfg, "ppo", Shapes(shape), Hardware(8, 80 * GIB, fsdp2=True))
    gen, scoring = _terms(plan, "generation"), _terms(plan, "scoring")
    whole = "gathered actor (FSDP2)"
    if gather:  # every unit gathered once per rollout, held through scoring
        assert gen[whole] == scoring[whole] == 2 * shape.lm_params()
    else:  # the root unit whole, the layers gathered one by one
        assert whole not in gen and whole not in scoring
        assert "gradients" not in gen  # freed by zero_grad(set_to_none) before the rollout
        root = shape.lm_params() - shape.layers * shape.layer_params()
        assert gen["gathered units (FSDP2)"] == (root + 2 * shape.layer_params()) * 2
        # the peak is the larger moment: the root's first all-gather (2 x root) or later
        # the root, two layers and the KV cache (here the larger; with short rollouts of
        # one row at a time not)
        short = _cfg("model.dtype=bfloat16", "reward.function=a:b", "generation.backend=hf",
                     "perf.gather_for_generation=false", "ppo.rollout_micro_batch_size=1",
                     "data.max_prompt_length=16", "generation.max_new_tokens=16", preset="grpo")  # fmt: skip
        brief = _terms(build_plan(short, "ppo", Shapes(shape), Hardware(8, 80 * GIB, fsdp2=True)), "generation")  # fmt: skip
        first = "the root unit's first all-gather (FSDP2)"
        assert gen[first] == 0 < brief[first]
        for terms in (gen, brief):
            rest = sum(b for k, b in terms.items() if k in ("gathered units (FSDP2)", "KV cache + sampling", "prefill"))  # fmt: skip
            resident = terms["weights"] + terms["optimizer states"]
            assert sum(terms.values()) == pytest.approx(resident + max(2 * root * 2, rest))


def test_frozen_models_are_replicated_under_fsdp2():
    shape = read_shape(str(SHAPES / "llama3-8b"), "model.policy")
    cfg = _cfg("model.dtype=bfloat16", "reward.function=a:b", "ppo.kl_coef=0.05", preset="grpo")
    for gpus in (2, 8):
        plan = build_plan(cfg, "ppo", Shapes(shape), Hardware(gpus, 80 * GIB, fsdp2=True))
        assert _terms(plan, "update")["reference"] == 2 * shape.lm_params()


def test_more_ranks_never_cost_more_per_rank_under_fsdp2():
    shapes = Shapes(read_shape(str(SHAPES / "llama3-8b"), "model.policy"))
    cfg = _cfg("model.dtype=bfloat16")
    peaks = [
        build_plan(cfg, "sft", shapes, Hardware(g, 80 * GIB, fsdp2=True)).binding.total
        for g in (1, 2, 8, 64)
    ]
    assert peaks == sorted(peaks, reverse=True) and peaks[0] > peaks[-1]
    # offloading everything leaves only the gathered units and activations on the device
    off = build_plan(cfg, "sft", shapes, Hardware(8, 80 * GIB, offload="all", fsdp2=True))
    assert off.binding.total < peaks[2]


def test_fsdp2_flags_and_launch_advice():
    hw = hardware(8, "80GiB", "auto", "none", "cuda", "fsdp2")
    assert hw.fsdp2 and hw.zero_stage is None and hw.sharded
    assert launch_steps(hw) == [("offload", "all")]
    with pytest.raises(ConfigError, match="--zero-stage"):
        hardware(8, "80GiB", "3", "none", "cuda", "fsdp2")
    with pytest.raises(ConfigError, match="--offload optimizer"):
        hardware(8, "80GiB", "auto", "optimizer", "cuda", "fsdp2")


def test_cli_plan_with_an_fsdp2_launch():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    args = ["--gpus", "8", "--engine", "fsdp2", "--stage", "sft", f"model.policy={SHAPES / 'llama3-8b'}", "data.train=x"]  # fmt: skip
    out = subprocess.run([sys.executable, "-m", "rlhf_dist", "plan", *args],
                         capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "FSDP2" in out.stdout and "gathered units (FSDP2)" in out.stdout


def test_a_lora_update_under_fsdp2_gathers_no_layer_gradients():
    shape = read_shape(str(SHAPES / "llama3-8b"), "model.policy")
    layer, root = shape.layer_params(), shape.lm_params() - shape.layers * shape.layer_params()
    hw = Hardware(8, 80 * GIB, fsdp2=True)
    base = ("model.dtype=bfloat16", "reward.function=a:b")
    full = _terms(build_plan(_cfg(*base, preset="grpo"), "ppo", Shapes(shape), hw), "update")
    lora_cfg = _cfg(*base, "lora.enabled=true", preset="grpo")
    lora = _terms(build_plan(lora_cfg, "ppo", Shapes(shape), hw), "update")
    name = "gathered units (FSDP2)"
    assert full[name] - lora[name] == layer * (2 + 4)  # bf16 and fp32 gradients of a layer
    assert lora[name] == (root + 2 * layer) * 2


def test_the_update_runs_each_prompt_once_where_the_forward_shares_prompts():
    shape = read_shape(str(SHAPES / "llama3-8b"), "model.policy")
    fsdp2, zero3 = Hardware(8, 80 * GIB, fsdp2=True), Hardware(8, 80 * GIB, zero_stage=3)
    # 16 prompts x 8 samples over 8 ranks: 2 prompts per rank, micro-batches of 4 rows
    base = ("model.dtype=bfloat16", "reward.function=a:b", "model.gradient_checkpointing=false",
            "ppo.rollout_batch_size=16", "ppo.samples_per_prompt=8", "ppo.micro_batch_size=4",
            "data.max_prompt_length=256", "generation.max_new_tokens=512")  # fmt: skip

    def activations(hw, *extra):
        plan = build_plan(_cfg(*base, *extra, preset="grpo"), "ppo", Shapes(shape), hw)
        return _terms(plan, "update")["activations"]

    # a micro-batch's 4 rows hold at most the rank's 2 distinct prompts
    shared = mem.shared_prompt_activations(shape, 4, 2, 256, 512, 2.0, "fused")
    assert activations(fsdp2) == shared
    whole = mem.kept_activations(shape, 4, 768, 2.0, "fused", False)
    assert shared < whole
    # ZeRO-3's partitioned weights and the switch off run whole rows (engine/forward.py
    # shares_prompts), as does a recomputing forward
    assert activations(zero3) == activations(fsdp2, "perf.shared_prompt_forward=false") == whole
    ckpt = mem.kept_activations(shape, 4, 768, 2.0, "fused", True)
    assert activations(fsdp2, "model.gradient_checkpointing=true") == ckpt
