"""Tests for rlhf_dist.algo.logprobs.logprobs_from_hidden: log-probs and entropies from
final hidden states and the output head, chunk by chunk, with the logits recomputed in
backward (docs/algorithms.md). Compared with the whole-logits computation
(`logprobs_and_entropy` of F.linear) in values and gradients, and probed for memory."""

import math
import random

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from rlhf_dist.algo.logprobs import logprobs_and_entropy, logprobs_from_hidden

LN2, LN3 = math.log(2.0), math.log(3.0)


# ---------------------------------------------------------------------------------------------
# Hand-computed case
# ---------------------------------------------------------------------------------------------


def test_hand_computed_logprobs_entropy_and_gradient():
    # H = 1, V = 3, W = [0, ln2, ln3]^T. Row 0: hidden 1 -> logits [0, ln2, ln3], p = 1/6,
    # 1/3, 1/2. Row 1: hidden 2 -> logits [0, 2 ln2, 2 ln3] -> p = (1, 4, 9) / 14.
    weight = torch.tensor([[0.0], [LN2], [LN3]], dtype=torch.float64, requires_grad=True)
    hidden = torch.tensor([[1.0], [2.0]], dtype=torch.float64, requires_grad=True)
    tokens = torch.tensor([2, 1])
    lp, h = logprobs_from_hidden(hidden, weight, tokens, chunk_tokens=1, with_entropy=True)
    # log p: ln(1/2) = -0.693147; ln(4/14) = -1.252763
    torch.testing.assert_close(lp, torch.tensor([-LN2, math.log(4 / 14)], dtype=torch.float64))
    # H row 0 = (1/6) ln6 + (1/3) ln3 + (1/2) ln2 = 1.011404;
    # row 1 = -(1/14 ln(1/14) + 4/14 ln(4/14) + 9/14 ln(9/14)) = 0.188504 + 0.357932 + 0.284007
    h1 = -sum(q * math.log(q) for q in (1 / 14, 4 / 14, 9 / 14))
    torch.testing.assert_close(h, torch.tensor([1.0114042647073518, h1], dtype=torch.float64))
    # d lp_0 / d hidden_0 = (onehot(2) - p) . W = -(1/3) ln2 + (1/2) ln3 = 0.318257;
    # d lp_0 / d W = (onehot(2) - p) * hidden_0 = [-1/6, -1/3, 1/2].
    lp[0].backward()
    assert hidden.grad[0, 0].item() == pytest.approx(-LN2 / 3 + LN3 / 2, abs=1e-12)
    assert hidden.grad[1, 0].item() == 0.0
    torch.testing.assert_close(
        weight.grad[:, 0], torch.tensor([-1 / 6, -1 / 3, 1 / 2], dtype=torch.float64)
    )


def test_temperature_hand_computed():
    # Row 1 of the hand case at temperature 2: logits / 2 = [0, ln2, ln3] -> p = 1/6, 1/3,
    # 1/2, so log p(token 2) = -ln2 and the entropy is row 0's at temperature 1.
    weight = torch.tensor([[0.0], [LN2], [LN3]], dtype=torch.float64)
    lp, h = logprobs_from_hidden(
        torch.tensor([[2.0]], dtype=torch.float64), weight, torch.tensor([2]), None, 2.0,
        with_entropy=True,
    )  # fmt: skip
    assert lp.item() == pytest.approx(-LN2, abs=1e-12)
    assert h.item() == pytest.approx(1.0114042647073518, abs=1e-12)


# ---------------------------------------------------------------------------------------------
# Properties: equal to the whole-logits computation, values and gradients
# ---------------------------------------------------------------------------------------------


def _leaf(x):
    return x.detach().clone().requires_grad_(True)


def _full(hidden, weight, bias, tokens, temperature):
    """Today's path: whole (N, V) logits, log_softmax, gather and entropy."""
    return logprobs_and_entropy(F.linear(hidden, weight, bias), tokens, temperature)


@pytest.mark.parametrize("seed", range(8))
def test_values_and_gradients_equal_the_whole_logits(seed):
    rng = random.Random(seed)
    n, h, v = rng.randint(1, 40), rng.randint(1, 12), rng.randint(2, 70)
    chunk = rng.choice([1, 3, 7, n, n + 5])  # mostly not dividing n
    temperature = rng.choice([1.0, 0.7, 1.3])
    g = torch.Generator().manual_seed(seed)
    hidden0, weight0 = torch.randn(n, h, generator=g), 0.5 * torch.randn(v, h, generator=g)
    bias0 = torch.randn(v, generator=g) if seed % 2 else None
    tokens = torch.randint(0, v, (n,), generator=g)
    g_lp, g_h = torch.randn(n, generator=g), torch.randn(n, generator=g)
    results = []
    for fn in ("chunked", "full"):
        hidden, weight = _leaf(hidden0), _leaf(weight0)
        bias = None if bias0 is None else _leaf(bias0)
        if fn == "chunked":
            lp, ent = logprobs_from_hidden(hidden, weight, tokens, bias, temperature, chunk, True)
        else:
            lp, ent = _full(hidden, weight, bias, tokens, temperature)
        ((lp * g_lp).sum() + (ent * g_h).sum()).backward()
        grads = [hidden.grad, weight.grad] + ([] if bias is None else [bias.grad])
        results.append([lp.detach(), ent.detach(), *grads])
    for name, a, b in zip(["logprobs", "entropy", "hidden", "weight", "bias"], *results):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=name)


@pytest.mark.parametrize("chunk", [2, 64])
def test_underflowing_probabilities_give_finite_equal_results(chunk):
    # Masked entries (-inf logits) and ones whose probability underflows to 0 (-200): the
    # entropy takes p log p as 0 there, never 0 * -inf, in values and gradients; with one
    # chunk the forward's kernels are the whole-logits path's, so its values are bitwise.
    g = torch.Generator().manual_seed(11)
    hidden0, weight0 = torch.randn(6, 4, generator=g), torch.randn(10, 4, generator=g)
    bias0 = torch.zeros(10)
    bias0[[1, 4]], bias0[[2, 7]] = float("-inf"), -200.0
    tokens = torch.tensor([0, 3, 5, 6, 8, 9])
    g_lp, g_h = torch.randn(6, generator=g), torch.randn(6, generator=g)
    results = []
    for fn in ("chunked", "full"):
        hidden, weight, bias = _leaf(hidden0), _leaf(weight0), _leaf(bias0)
        if fn == "chunked":
            lp, ent = logprobs_from_hidden(hidden, weight, tokens, bias, 1.0, chunk, True)
        else:
            lp, ent = _full(hidden, weight, bias, tokens, 1.0)
        ((lp * g_lp).sum() + (ent * g_h).sum()).backward()
        results.append([lp.detach(), ent.detach(), hidden.grad, weight.grad, bias.grad])
    for name, a, b in zip(["logprobs", "entropy", "hidden", "weight", "bias"], *results):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=name)
    if chunk >= 6:
        assert torch.equal(results[0][0], results[1][0])
        assert torch.equal(results[0][1], results[1][1])
    assert (results[0][4][[1, 4, 2, 7]] == 0).all()  # no gradient reaches p = 0 entries


@pytest.mark.parametrize("with_entropy", [False, True])
def test_logprob_gradient_alone_and_entropy_unused(with_entropy):
    # A loss on the log-probs only (the entropy not asked for, or asked for and unused):
    # the gradients are those of the log-probs.
    g = torch.Generator().manual_seed(3)
    hidden0, weight0 = torch.randn(9, 5, generator=g), torch.randn(11, 5, generator=g)
    tokens = torch.randint(0, 11, (9,), generator=g)
    hidden, weight = _leaf(hidden0), _leaf(weight0)
    lp, ent = logprobs_from_hidden(hidden, weight, tokens, None, 0.8, 4, with_entropy)
    assert (ent is None) == (not with_entropy)
    lp.sum().backward()
    ref_hidden, ref_weight = _leaf(hidden0), _leaf(weight0)
    ref_lp, _ = _full(ref_hidden, ref_weight, None, tokens, 0.8)
    ref_lp.sum().backward()
    torch.testing.assert_close(hidden.grad, ref_hidden.grad, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(weight.grad, ref_weight.grad, atol=1e-6, rtol=1e-6)


def test_frozen_head_and_no_tokens():
    g = torch.Generator().manual_seed(4)
    weight = torch.randn(6, 3, generator=g)  # frozen: no gradient asked for it
    hidden = torch.randn(5, 3, generator=g, requires_grad=True)
    lp, _ = logprobs_from_hidden(hidden, weight, torch.randint(0, 6, (5,), generator=g), None)
    lp.sum().backward()
    assert hidden.grad is not None and weight.grad is None
    empty, ent = logprobs_from_hidden(hidden[:0], weight, torch.zeros(0, dtype=torch.long))
    assert empty.shape == (0,) and ent is None


def test_inputs_are_not_modified_and_chunk_size_is_checked():
    g = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(7, 4, generator=g), torch.randn(9, 4, generator=g)
    tokens = torch.randint(0, 9, (7,), generator=g)
    copies = [hidden.clone(), weight.clone(), tokens.clone()]
    logprobs_from_hidden(hidden, weight, tokens, None, 0.7, 2, True)
    for x, y in zip((hidden, weight, tokens), copies):
        assert torch.equal(x, y)
    with pytest.raises(ValueError, match="chunk_tokens"):
        logprobs_from_hidden(hidden, weight, tokens, chunk_tokens=0)


def test_bf16_head_is_computed_like_the_models_own_head():
    # A bf16 head: the logits are a bf16 matmul upcast to fp32 (what the model's lm_head
    # followed by scale_logits gave), so the values equal the whole-logits path's.
    g = torch.Generator().manual_seed(6)
    hidden = torch.randn(10, 8, generator=g).bfloat16()
    weight = torch.randn(13, 8, generator=g).bfloat16()
    tokens = torch.randint(0, 13, (10,), generator=g)
    lp, ent = logprobs_from_hidden(hidden, weight, tokens, None, 0.7, 3, True)
    ref_lp, ref_ent = _full(hidden, weight, None, tokens, 0.7)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, ref_lp, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent, ref_ent, atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# Memory: the peak does not grow with N x V
# ---------------------------------------------------------------------------------------------


def _peak_allocated_bytes(step) -> int:
    """The most bytes torch's CPU allocator held at once while `step()` ran, over what it
    held when it began: the profiler records every tensor allocation and free, so this is
    the tensors' own peak, the same on every run (process RSS also counts malloc's kept
    blocks and the import-time high-water mark, and inside the whole suite it varied by
    hundreds of MiB)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = prof.profiler.kineto_results.events()
    deltas = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    held = peak = 0
    for _, nbytes in deltas:
        held += nbytes
        peak = max(peak, held)
    return peak


def test_peak_memory_does_not_scale_with_tokens_times_vocabulary():
    n, h, v = 8192, 32, 4096
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = (0.1 * torch.randn(v, h, generator=g)).requires_grad_(True)
    tokens = torch.randint(0, v, (n,), generator=g)

    def chunked():
        lp, ent = logprobs_from_hidden(hidden, weight, tokens, None, 0.7, 128, True)
        (lp.sum() + ent.sum()).backward()

    def full():
        lp, ent = logprobs_and_entropy(F.linear(hidden, weight), tokens, 0.7)
        (lp.sum() + ent.sum()).backward()

    whole = n * v * 4  # one fp32 (N, V) tensor: 128 MiB
    # The whole-logits path holds several (N, V) tensors at its peak (~5 measured).
    assert _peak_allocated_bytes(full) > 3 * whole
    # Chunks of 128 rows: a few (128, V) tensors (2 MiB each), the (V, H) weight gradient
    # and the (N, H) hidden gradient: ~10 MiB measured, far under one (N, V) tensor.
    assert _peak_allocated_bytes(chunked) < whole / 4
