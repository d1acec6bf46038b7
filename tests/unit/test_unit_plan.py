"""The memory planner (rlhf_dist/planning): hand-computed terms, properties of the plan,
and `rlhf-dist plan` on the shipped 8B and 70B shapes (exit 2 with a fix that, applied,
fits and validates). The estimate against measured peaks: launch/bench/memory.py plan and
tests/integration/test_integration_plan_measured.py."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_dist.config import load_config, validate
from rlhf_dist.planning import GIB, Hardware, ModelShape, Shapes, build_plan, find_fix
from rlhf_dist.planning import memory as mem
from rlhf_dist.planning.advice import parse_memory, with_overrides
from rlhf_dist.planning.shapes import read_shape

ROOT = Path(__file__).resolve().parents[2]
SHAPES = ROOT / "launch/configs/shapes"
TINY = ModelShape(vocab=10, hidden=4, layers=2, heads=2, kv_heads=1, head_dim=2, intermediate=8)


def test_parameter_counts_of_the_shipped_shapes():
    # The published sizes: Llama-3-8B 8,030,261,248 and Llama-3-70B 70,553,706,496 weights.
    assert read_shape(str(SHAPES / "llama3-8b"), "model.policy").lm_params() == 8_030_261_248
    assert read_shape(str(SHAPES / "llama3-70b"), "model.policy").lm_params() == 70_553_706_496


def test_tiny_shape_by_hand():
    # q 4x4, k and v 4x2 each, o 4x4, gate/up/down 4x8 each: 16+8+8+16+96 = 144
    assert TINY.linear_params() == 144
    # + two norms of 4 = 152 per layer; embedding 40 + 2 layers + final norm 4 + head 40
    assert TINY.lm_params() == 40 + 2 * 152 + 4 + 40
    # LoRA r=1 on q (4+4) and down (8+4): 20 per layer
    assert TINY.lora_params(1, ("q_proj", "down_proj")) == 40


def test_model_states_by_hand():
    # ZeRO paper: bf16 Adam is 2 + 2 + 12 bytes per weight; stage 2 over 4 ranks
    s = mem.model_states(1000, 0.0, 2.0, zero_stage=2, world=4)
    assert (s.params, s.grads, s.optimizer) == (2000, 500, 3000)
    # ZeRO-3 also holds the optimizer's fp32 gradients (4 x 250) and the whole gradient
    # bucket (100 bf16 elements) on every rank
    s3 = mem.model_states(1000, 0.0, 2.0, zero_stage=3, world=4, bucket=100)
    assert (s3.params, s3.grads, s3.optimizer) == (500, 500 + 1000 + 200, 3000)
    s3 = mem.model_states(1000, 0.0, 2.0, zero_stage=3, world=4, offload="optimizer")
    assert (s3.params, s3.grads, s3.optimizer, s3.cpu) == (500, 500, 0, 3000 + 1000)
    # the fp32 gradient buffer is one sub-group's (1e9 elements) however large the partition
    big = mem.model_states(8e9, 0.0, 2.0, zero_stage=3, world=2)
    assert big.grads == 2.0 * 4e9 + 4.0 * mem.ZERO3_SUB_GROUP
    # no DeepSpeed: fp32 weights, gradients, and Adam's two moments; DDP's buckets
    plain = mem.model_states(1000, 0.0, 2.0, zero_stage=None, world=2)
    assert (plain.params, plain.grads, plain.optimizer) == (4000, 8000, 8000)


def test_kv_cache_and_layer_activations_by_hand():
    # 2 (k, v) x 2 layers x 3 rows x 5 tokens x 1 head x 2 dims x 2 bytes
    assert mem.kv_cache(TINY, 3, 5, 2.0) == 2 * 2 * 3 * 5 * 1 * 2 * 2
    # 10h + 2kd + 4f + the eager softmax a x s: 40 + 4 + 32 + 2 x 7
    assert mem.layer_activation_elements(TINY, 7, "eager") == 90
    assert mem.layer_activation_elements(TINY, 7, "fused") == 40 + 4 + 32 + 2


def test_lora_activations_by_hand():
    # one token of TINY: 2 layers x 78 (10h + 2kd + 4f + a) + 4h = 172 elements; with LoRA
    # r 1: 7 x 2 adapter intermediates, and the frozen norms keep (2L + 2)h = 24 less
    assert mem.kept_activations(TINY, 1, 1, 1.0, "fused", False) == 172
    assert mem.kept_activations(TINY, 1, 1, 1.0, "fused", False, lora_rank=1) == 172 - 24 + 14
    # checkpointing: each layer's input (2h), the adapters', 4h less the final norm's h
    assert mem.kept_activations(TINY, 1, 1, 1.0, "fused", True, lora_rank=1) == 8 + 14 + 16 - 4


def test_shared_prompt_activations_by_hand():
    # perf.shared_prompt_forward: 1 distinct prompt of 3 tokens (3 x 172 elements, as
    # above), then 4 responses of 5 tokens over its cache (20 x 172); that forward also
    # keeps each row's 3 cached keys and values in both layers, expanded to a d = 4 (2 x 2 x
    # 4 x 3 x 4 = 192), and the (4, 1, 5, 3 + 5) mask (160)
    fused = mem.shared_prompt_activations(TINY, 4, 1, 3, 5, 1.0, "fused")
    assert fused == 3 * 172 + 20 * 172 + 192 + 160
    # eager: a response token's probabilities span the 8 keys, a prompt token's its 3
    eager = mem.shared_prompt_activations(TINY, 4, 1, 3, 5, 1.0, "eager")
    assert eager - fused == 2 * 2 * (3 * (3 - 1) + 20 * (8 - 1))


@pytest.mark.parametrize("rank", [0, 16])
@pytest.mark.parametrize("name", ["llama3-8b", "qwen2.5-7b"])
def test_sharing_prompts_keeps_each_prompt_once_plus_the_cache(name, rank):
    shape = read_shape(str(SHAPES / name), "model.policy")
    per_token = mem.kept_activations(shape, 1, 1, 2.0, "fused", False, rank)
    for rows, P, T in ((8, 16, 32), (4, 512, 1024)):
        whole = mem.kept_activations(shape, rows, P + T, 2.0, "fused", False, rank)
        cache = 2 * shape.layers * rows * P * shape.heads * shape.head_dim + rows * T * (P + T)
        shared = [
            mem.shared_prompt_activations(shape, rows, u, P, T, 2.0, "fused", rank)
            for u in range(1, rows + 1)
        ]
        # every row its own prompt: the whole rows' tokens, plus the cache the second keeps
        assert shared[-1] == pytest.approx(whole + 2.0 * cache)
        # each distinct prompt more: its P tokens once more
        assert all(b - a == pytest.approx(P * per_token) for a, b in zip(shared, shared[1:]))


@pytest.mark.parametrize("rank", [1, 8, 64])
@pytest.mark.parametrize("name", ["llama3-8b", "qwen2.5-7b"])
def test_lora_activations_differ_by_the_adapters_less_the_frozen_norms(name, rank):
    shape = read_shape(str(SHAPES / name), "model.policy")
    for rows, seq in ((1, 16), (3, 1024)):
        full = mem.kept_activations(shape, rows, seq, 2.0, "fused", False)
        lora = mem.kept_activations(shape, rows, seq, 2.0, "fused", False, rank)
        per_token = 7 * shape.layers * rank - (2 * shape.layers + 2) * shape.hidden
        assert lora - full == pytest.approx(rows * seq * 2.0 * per_token)


@pytest.mark.parametrize("seq", [16, 128, 1024])
def test_activations_grow_with_rows_and_shrink_with_checkpointing(seq):
    shape = read_shape(str(SHAPES / "llama3-8b"), "model.policy")
    one = mem.kept_activations(shape, 1, seq, 2.0, "fused", False)
    assert mem.kept_activations(shape, 2, seq, 2.0, "fused", False) == pytest.approx(2 * one)
    assert mem.kept_activations(shape, 1, seq, 2.0, "fused", True) < one / 4


def _cfg(*overrides, preset=None):
    return load_config(None, [f"model.policy={SHAPES / 'llama3-8b'}", "data.train=x", *overrides], preset)  # fmt: skip


def test_more_ranks_and_higher_stages_never_cost_more_per_rank():
    # (ZeRO-3's whole-model gather per step, perf.gather_for_training, costs a full copy
    # more: off here)
    cfg = _cfg("perf.gather_for_training=never")
    shapes = Shapes(read_shape(str(SHAPES / "llama3-8b"), "model.policy"))
    peaks = {}
    for gpus in (1, 2, 8):
        for stage in (None, 0, 2, 3):
            hw = Hardware(gpus, 80 * GIB, stage)
            peaks[gpus, stage] = build_plan(cfg, "sft", shapes, hw).binding.total
    for gpus in (2, 8):
        assert peaks[gpus, 3] <= peaks[gpus, 2] <= peaks[gpus, 0]
        assert peaks[gpus, 3] < peaks[1, 3]


def test_the_fix_makes_the_plan_fit_and_validates():
    cfg = _cfg(
        "model.gradient_checkpointing=false",
        "sft.micro_batch_size=8",
        "sft.batch_size=64",
        "data.max_length=4096",
    )
    shapes = Shapes(read_shape(str(SHAPES / "llama3-8b"), "model.policy"))
    hw = Hardware(8, 80 * GIB, 3)
    assert not build_plan(cfg, "sft", shapes, hw).fits
    fix = find_fix(cfg, "sft", shapes, hw)
    assert fix is not None and not fix.launch
    fixed = with_overrides(cfg, fix.overrides)
    assert build_plan(fixed, "sft", shapes, hw).fits
    validate(fixed, "sft", 8)


def test_parse_memory():
    assert parse_memory("80GiB") == 80 * GIB
    assert parse_memory("80GB") == 80e9
    assert parse_memory("141") == 141 * GIB


def _plan_cli(*args):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    return subprocess.run(
        [sys.executable, "-m", "rlhf_dist", "plan", *args],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=env,
    )  # fmt: skip


def test_cli_refuses_with_one_line_and_its_fix_fits():
    base = ["--gpus", "8", "--stage", "grpo", f"model.policy={SHAPES / 'llama3-70b'}",
            "data.train=x", "reward.function=a:b"]  # fmt: skip
    out = _plan_cli(*base)
    assert out.returncode == 2, out.stderr
    line = out.stderr.strip()
    assert "\n" not in line and line.startswith("rlhf-dist plan: error: does not fit")
    assert "generation" in out.stdout and "update" in out.stdout
    fix = line.split("fix: ", 1)[1].split()
    assert all("=" in f for f in fix), fix  # config keys only: pasted as they are
    again = _plan_cli(*base, *fix)
    assert again.returncode == 0, again.stderr
    assert "fits:" in again.stdout


def test_auto_fit_takes_the_largest_micro_batch_that_fits_a_cap():
    from rlhf_dist.planning.start import auto_fit

    cfg = _cfg("sft.batch_size=64", "sft.micro_batch_size=1", "data.max_length=1024",
               "model.gradient_checkpointing=false")  # fmt: skip
    shapes = Shapes(read_shape(str(SHAPES / "llama3-8b"), "model.policy"))
    hw = Hardware(8, 80 * GIB, 3)
    (change,) = auto_fit(cfg, "sft", shapes, hw)
    micro = int(change.split("=")[1])
    assert 1 < micro < 8  # the rank's share is 8; all of it does not fit, one is not the most
    assert build_plan(with_overrides(cfg, (change,)), "sft", shapes, hw).fits
    bigger = next(d for d in range(micro + 1, 9) if 8 % d == 0)
    assert not build_plan(with_overrides(cfg, (f"sft.micro_batch_size={bigger}",)), "sft", shapes, hw).fits  # fmt: skip


def test_a_gpu_run_that_cannot_fit_is_refused_before_loading_and_its_fix_starts():
    from rlhf_dist.errors import ConfigError
    from rlhf_dist.planning.start import plan_at_start

    cfg = _cfg("sft.batch_size=64", "sft.micro_batch_size=8", "data.max_length=4096",
               "model.gradient_checkpointing=false")  # fmt: skip
    hw = Hardware(8, 80 * GIB, 3)
    with pytest.raises(ConfigError, match="fix: ") as refused:
        plan_at_start(cfg, "sft", hw)
    fix = tuple(str(refused.value).split("fix: ", 1)[1].split())
    fixed, lines = plan_at_start(with_overrides(cfg, fix), "sft", hw)
    assert lines[-1].startswith("memory plan per rank: update ") and "fits in" in lines[-1]
    # auto_fit derives a new config instead (the given one is left as it was)
    fitted, lines = plan_at_start(with_overrides(cfg, ("run.auto_fit=true",)), "sft", hw)
    assert (
        lines[0].startswith("run.auto_fit: sft.micro_batch_size=") and cfg.sft.micro_batch_size == 8
    )
    assert fitted.sft.micro_batch_size < 8


def test_sequence_parallel_that_does_not_divide_the_heads_is_refused_before_loading():
    from rlhf_dist.errors import ConfigError
    from rlhf_dist.planning.start import plan_at_start

    # Qwen2.5-7B has 28 attention heads: 8 does not divide them, 4 does (read from
    # config.json alone, on CPU too: it is a config error, not a memory estimate)
    qwen = f"model.policy={SHAPES / 'qwen2.5-7b'}"
    for device in ("cuda", "cpu"):
        hw = Hardware(8, 80 * GIB, 3, device=device)
        with pytest.raises(ConfigError, match=r"^distributed.sequence_parallel_size=8 must divide the model's 28 attention heads$"):  # fmt: skip
            plan_at_start(_cfg(qwen, "distributed.sequence_parallel_size=8"), "sft", hw)
        plan_at_start(_cfg(qwen, "distributed.sequence_parallel_size=4"), "sft", hw)


def test_head_bytes_by_hand():
    # chunks of 3 tokens share one (2, 3, V) fp32 workspace: 2 x 3 x 10 x 4 bytes
    assert mem.head_bytes(TINY, tokens=7, chunk_tokens=3, training=True) == 240
    assert mem.head_bytes(TINY, tokens=2, chunk_tokens=3, training=False) == 160  # 2 rows only
    # whole logits: the (7, V) logits and log-softmax (+ both gradients in training)
    assert mem.head_bytes(TINY, tokens=7, chunk_tokens=0, training=False) == 2 * 7 * 10 * 4
    assert mem.head_bytes(TINY, tokens=7, chunk_tokens=0, training=True) == 4 * 7 * 10 * 4
    # a bf16 head: each chunk's (3, V) bf16 logits before the upcast (+ 3 x 10 x 2), and
    # under autocast the (V, h) head cast once per pass (+ 10 x 4 x 2)
    assert mem.head_bytes(TINY, 7, 3, True, compute_bytes=2.0) == 240 + 60
    assert mem.head_bytes(TINY, 7, 3, True, compute_bytes=2.0, cast_head=True) == 240 + 60 + 80


def _terms(plan, phase):
    return dict(next(p for p in plan.phases if p.name == phase).terms)


def test_autocast_copies_of_the_trained_linears_by_phase():
    # bf16 on one GPU without DeepSpeed: fp32 weights, bf16 autocast. torch caches a bf16
    # copy of each trained linear weight until the outermost region exits: the rollout is
    # one region (the actor's copies from sampling, the critic's from scoring), the
    # update's forwards save theirs for backward, except under checkpointing.
    shape = read_shape(str(SHAPES / "llama3-8b"), "model.policy")
    shapes, hw = Shapes(shape), Hardware(1, 80 * GIB, None, device="cuda")
    actor = 2.0 * shape.layers * shape.linear_params()
    name = "bf16 weight copies (autocast)"
    base = ("model.dtype=bfloat16", "model.gradient_checkpointing=false", "ppo.estimator=gae",
            "ppo.critic_init=policy", "reward.function=a:b")  # fmt: skip

    def plan_of(*extra, hw=hw):
        return build_plan(_cfg(*base, *extra), "ppo", shapes, hw)

    plan = plan_of()
    assert _terms(plan, "generation")[name] == actor
    assert _terms(plan, "scoring")[name] == 2 * actor  # the critic is the policy's shape
    assert _terms(plan, "update")[name] == 2 * actor
    ckpt = plan_of("model.gradient_checkpointing=true")
    assert name not in _terms(ckpt, "update") and _terms(ckpt, "scoring")[name] == 2 * actor
    lora = plan_of("lora.enabled=true", "lora.critic=true")
    assert all(name not in _terms(lora, p) for p in ("generation", "scoring", "update"))
    fp32 = plan_of("model.dtype=float32")
    assert all(name not in _terms(fp32, p) for p in ("generation", "scoring", "update"))
    zero3 = plan_of(hw=Hardware(8, 80 * GIB, 3, device="cuda"))
    assert all(name not in _terms(zero3, p) for p in ("generation", "scoring", "update"))


def test_lora_and_qlora_hold_less_than_full_training():
    shapes = Shapes(read_shape(str(SHAPES / "llama3-8b"), "model.policy"))
    hw = Hardware(1, 80 * GIB, None)
    base = ["ppo.kl_coef=0", "reward.function=a:b"]
    peaks = [
        build_plan(_cfg(*base, *extra, preset="grpo"), "ppo", shapes, hw).binding.total
        for extra in ([], ["lora.enabled=true"], ["lora.enabled=true", "lora.load_in_4bit=true"])
    ]
    assert peaks[0] > peaks[1] > peaks[2]


def test_plan_asks_only_for_what_it_reads():
    """A 7B GRPO plan from the shipped 8-GPU file answers without data.train or a reward
    spec (it opens neither), with the same figures as with them; the config's own rules
    still hold (exit 2, one line naming the key)."""
    grpo = ["--config", "launch/configs/grpo_zero3_8gpu.yaml", "--stage", "grpo", "--gpus", "8"]
    policy = f"model.policy={SHAPES / 'llama3-8b'}"
    without = _plan_cli(*grpo, policy, "data.train=", "reward.function=")
    assert without.returncode == 0, without.stderr
    assert "fits: generation binds" in without.stdout
    assert without.stdout == _plan_cli(*grpo, policy).stdout
    bare = _plan_cli("--stage", "grpo", "--gpus", "8", policy)  # no file, no data, no reward
    assert bare.returncode == 0 and "fits:" in bare.stdout, bare.stderr
    for stage in ("sft", "dpo"):  # the step-loop stages need no data file either
        out = _plan_cli("--stage", stage, "--gpus", "8", policy)
        assert out.returncode == 0 and "fits:" in out.stdout, out.stderr
    bad = _plan_cli(*grpo, policy, "data.train=", "ppo.samples_per_prompt=1")
    assert bad.returncode == 2 and bad.stderr.startswith(
        "rlhf-dist plan: error: ppo.samples_per_prompt"
    )
    # the model it reads is still required
    none = _plan_cli("--stage", "grpo", "--gpus", "8")
    assert none.returncode == 2 and "model.policy: required" in none.stderr


def test_validate_without_inputs_keeps_the_rules_between_keys():
    from rlhf_dist.config import ConfigError

    bare = load_config(None, [f"model.policy={SHAPES / 'llama3-8b'}"], "grpo")
    validate(bare, "ppo", 8, inputs=False)
    with pytest.raises(ConfigError, match="data.train: required"):
        validate(bare, "ppo", 8)
    with pytest.raises(ConfigError, match="ppo.rollout_batch_size"):
        validate(with_overrides(bare, ("ppo.rollout_batch_size=12",)), "ppo", 8, inputs=False)


def test_the_planner_counts_the_models_the_trainer_loads_by_its_rules():
    """Which frozen models are resident comes from config/sizes.py, the rules the trainer
    follows: a LoRA critic started from the reward model is the reward model too (adapters
    off), one started from the policy is not, so the reward model is loaded beside it."""
    from rlhf_dist.config import sizes
    from rlhf_dist.planning.plan import frozen_models

    shapes = Shapes(
        read_shape(str(SHAPES / "llama3-8b"), "model.policy"),
        read_shape(str(SHAPES / "qwen2.5-7b"), "model.reward"),
    )
    lora = ["lora.enabled=true", "lora.critic=true", f"model.reward={SHAPES / 'qwen2.5-7b'}"]
    hw = Hardware(8, 80 * GIB, 3)
    shared = _cfg(*lora)
    assert sizes.shares_reward_with_critic(shared)
    assert [n for n, _ in frozen_models(shared, shapes, hw, "ppo")] == []  # reference: adapters off
    separate = _cfg(*lora, "ppo.critic_init=policy")
    assert not sizes.shares_reward_with_critic(separate)
    assert [n for n, _ in frozen_models(separate, shapes, hw, "ppo")] == ["reward model"]
    grpo = _cfg(f"model.reward={SHAPES / 'qwen2.5-7b'}", preset="grpo")  # kl_coef 0
    assert not sizes.has_critic(grpo) and not sizes.needs_reference(grpo)
    assert [n for n, _ in frozen_models(grpo, shapes, hw, "ppo")] == ["reward model"]
