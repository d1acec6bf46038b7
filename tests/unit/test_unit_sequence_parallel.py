"""Sequence parallelism's pieces in one process (engine/sequence_parallel.py): a group of
one runs the whole split path (rows shifted before the cut, the (R, 1, W, W) mask, the
Ulysses attention function, packed rows) without a collective, so its log-probs and
gradients must equal the plain forward's. The 2-rank split (n = 2) is
tests/distributed/test_dist_split_invariance.py."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlhf_dist.config import PerfConfig, load_config, validate
from rlhf_dist.distributed.sequence_parallel import SequenceGroup, sequence_parallel
from rlhf_dist.engine import sequence_parallel as engine_sp
from rlhf_dist.engine.forward import token_logprobs
from rlhf_dist.engine.sequence_parallel import _row_mask, check_heads, sequence_rows
from rlhf_dist.errors import ConfigError

V = 50
ONE = SequenceGroup(1, 0, None)


def tiny_lm(heads: int = 4, kv: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=kv, intermediate_size=64, max_position_embeddings=64,
        attention_dropout=0.0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def batch(left: bool = True):
    """(ids, mask, predict_mask (B, L - 1)) of 3 rows: left-padded (or right-padded with
    left=False), full, right-padded."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, V, (3, 11), generator=g)
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[0, :3] = 0
    if not left:
        mask[0] = mask[0].flip(0)
    mask[2, 8:] = 0
    predict = mask[:, 1:].bool() & (torch.arange(10) >= 4)
    return ids, mask, predict


def forward_and_grads(model, perf, group, left=True):
    model.zero_grad()
    ids, mask, predict = batch(left)
    with sequence_parallel(group):
        lp, ent = token_logprobs(model, ids, mask, predict, 0.7, True, perf=perf)
    (lp.sum() + ent.sum()).backward()
    return lp.detach(), ent.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize(("packed", "left"), [(False, True), (False, False), (True, True)])
def test_a_group_of_one_gives_the_plain_forward_and_gradient(packed, left, monkeypatch):
    model = tiny_lm()
    perf = PerfConfig(packed_sequences=packed, logprob_chunk_tokens=4)
    lp, ent, grads = forward_and_grads(model, perf, None, left)
    exchanges = []  # every layer's q, k, v go through the Ulysses attention function

    def counted(x, sg):
        exchanges.append(x.shape)
        return x

    monkeypatch.setattr(engine_sp, "scatter_heads", counted)
    lp1, ent1, grads1 = forward_and_grads(model, perf, ONE, left)
    assert len(exchanges) == 3 * model.config.num_hidden_layers
    assert model.config._attn_implementation == "sdpa"  # switched back after the forward
    torch.testing.assert_close(lp1, lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent1, ent, rtol=0, atol=1e-5)
    for a, b in zip(grads1, grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert bool((lp1 == 0).eq(~batch(left)[2]).all())  # 0 exactly where nothing is scored
    # right padding alone: causal attention, no (W, W) mask; otherwise the whole-row mask
    ids, mask, predict = batch(left)
    rows = sequence_rows(model, ids, mask, predict, perf, 1)
    assert (rows.mask is None) == (not left and not packed)


def test_the_row_mask_by_hand():
    # padded: row of 3 with its first column padding; every query sees itself
    mask = _row_mask(torch.tensor([[0, 0, 1]]), torch.tensor([[False, True, True]]))
    expected = torch.tensor([[1, 0, 0], [0, 1, 0], [0, 1, 1]], dtype=torch.bool)
    assert torch.equal(mask[0, 0], expected)
    # packed: two sequences [0, 1] and [0] in one row
    mask = _row_mask(torch.tensor([[0, 1, 0]]), None)
    expected = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.bool)
    assert torch.equal(mask[0, 0], expected)


def test_heads_that_the_size_does_not_divide_are_one_line_naming_the_key():
    config = tiny_lm(heads=4, kv=2).config
    check_heads(config, 4)  # 2 KV heads are copied per query head over 4 ranks
    with pytest.raises(ConfigError, match=r"^distributed.sequence_parallel_size=3 .*4 attention"):
        check_heads(config, 3)


SFT = ["model.policy=/p", "data.train=/d.jsonl", "distributed.sequence_parallel_size=2"]
PPO = [
    *SFT,
    "reward.function=m:f",
    "ppo.estimator=grpo",
    "ppo.samples_per_prompt=4",
    "ppo.micro_batch_size=8",
]


def one_line_error(cfg, stage: str, world_size: int) -> str:
    with pytest.raises(ConfigError) as info:
        validate(cfg, stage, world_size)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_the_combinations_it_does_not_support_are_one_line_naming_the_key():
    validate(load_config(overrides=SFT), "sft", world_size=2)
    validate(load_config(overrides=SFT), "dpo", world_size=2)
    validate(load_config(overrides=PPO), "ppo", world_size=2)
    message = one_line_error(load_config(overrides=SFT), "sft", world_size=1)
    assert message.startswith("distributed.sequence_parallel_size=2 must divide world size=1")
    validate(load_config(overrides=SFT), "kto", world_size=2)
    message = one_line_error(load_config(overrides=SFT), "rm", world_size=2)
    assert message.startswith("distributed.sequence_parallel_size=2: rm")
    refused = {
        "ppo.estimator": ["ppo.estimator=gae"],
        "ppo.ptx_coef": ["ppo.ptx_coef=0.5", "data.ptx=/p.jsonl"],
    }
    for key, extra in refused.items():
        message = one_line_error(load_config(overrides=[*PPO, *extra]), "ppo", world_size=2)
        assert message.startswith(f"distributed.sequence_parallel_size=2: not supported with {key}")


def test_the_planner_divides_activations_by_the_group_and_adds_the_exchange():
    from pathlib import Path

    from rlhf_dist.planning import GIB, Hardware, ModelShape, Shapes, build_plan
    from rlhf_dist.planning import memory as mem
    from rlhf_dist.planning.shapes import read_shape

    tiny = ModelShape(vocab=10, hidden=4, layers=2, heads=2, kv_heads=1, head_dim=2,
                      intermediate=8)  # fmt: skip
    # 2 layers x 3 rows x 8 positions / 2 ranks x (h + 2kd = 8) x 2 bytes + 3 x 8 x 8 mask
    assert mem.sequence_parallel_buffers(tiny, 3, 8, 2, 2.0, False, True) == 2 * 3 * 4 * 8 * 2 + 192
    assert mem.sequence_parallel_buffers(tiny, 3, 8, 2, 2.0, True, True) == 3 * 4 * 8 * 2 + 192
    assert mem.sequence_parallel_buffers(tiny, 3, 8, 2, 2.0, True, False) == 3 * 4 * 8 * 2
    shape = Path(__file__).resolve().parents[2] / "launch/configs/shapes/llama3-8b"
    shapes = Shapes(read_shape(str(shape), "model.policy"))

    def update_terms(n: int, packed: bool = False) -> dict:
        cfg = load_config(None, [
            f"model.policy={shape}", "data.train=x", "data.max_length=32768",
            "sft.micro_batch_size=1", f"distributed.sequence_parallel_size={n}",
            f"perf.packed_sequences={packed}",
        ])  # fmt: skip
        plan = build_plan(cfg, "sft", shapes, Hardware(8, 80 * GIB, 3))
        return dict(next(p for p in plan.phases if p.name == "update").terms)

    one, two = update_terms(1), update_terms(2)
    assert two["activations"] == pytest.approx(one["activations"] / 2)
    assert "sequence-parallel exchange" in two and "sequence-parallel exchange" not in one
    # packed rows need the whole-row mask: 32768^2 bytes more
    packed = update_terms(2, packed=True)["sequence-parallel exchange + row mask"]
    assert packed == pytest.approx(two["sequence-parallel exchange"] + 32768**2)


def test_the_planners_fix_names_the_size_when_micro_batches_of_one_do_not_fit():
    from pathlib import Path

    from rlhf_dist.planning import GIB, Hardware, Shapes, build_plan, find_fix, with_overrides
    from rlhf_dist.planning.shapes import read_shape

    shape = Path(__file__).resolve().parents[2] / "launch/configs/shapes/llama3-8b"
    shapes, hw = Shapes(read_shape(str(shape), "model.policy")), Hardware(8, 80 * GIB, 3)
    cfg = load_config(None, [
        f"model.policy={shape}", "data.train=x", "data.max_length=131072", "sft.batch_size=8",
        "sft.micro_batch_size=1", "model.gradient_checkpointing=true",
    ])  # fmt: skip
    assert not build_plan(cfg, "sft", shapes, hw).fits
    fix = find_fix(cfg, "sft", shapes, hw)
    assert fix is not None and "distributed.sequence_parallel_size=2" in fix.overrides
    fixed = with_overrides(cfg, fix.overrides)
    assert build_plan(fixed, "sft", shapes, hw).fits
    validate(fixed, "sft", 8)
