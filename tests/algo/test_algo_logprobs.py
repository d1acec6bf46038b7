"""Tests for rlhf_dist.algo.logprobs (logprobs_from_logits, entropy_from_logits,
scale_logits, logprobs_and_entropy)."""

import math

import pytest
import torch

from rlhf_dist.algo.logprobs import (
    entropy_from_logits,
    logprobs_and_entropy,
    logprobs_from_logits,
    scale_logits,
)

SEEDS = [0, 1, 2]
LN2, LN3 = math.log(2.0), math.log(3.0)


# ---------------------------------------------------------------------------------------------
# float64 references: loops over batch, time and vocabulary with the math module.
# ---------------------------------------------------------------------------------------------


def _log_softmax_row(row, temperature=1.0):
    scaled = [v / temperature for v in row]
    m = max(scaled)
    lse = m + math.log(sum(math.exp(v - m) for v in scaled))
    return [v - lse for v in scaled]


def ref_logprobs(logits, tokens, temperature=1.0):
    lg, tk = logits.tolist(), tokens.tolist()
    out = [[0.0] * len(lg[0]) for _ in lg]
    for b in range(len(lg)):
        for t in range(len(lg[0])):
            out[b][t] = _log_softmax_row(lg[b][t], temperature)[tk[b][t]]
    return torch.tensor(out, dtype=torch.float64)


def ref_entropy(logits):
    # H = -sum_v p_v log p_v
    lg = logits.tolist()
    out = [[0.0] * len(lg[0]) for _ in lg]
    for b in range(len(lg)):
        for t in range(len(lg[0])):
            logp = _log_softmax_row(lg[b][t])
            out[b][t] = -sum(math.exp(lp) * lp for lp in logp)
    return torch.tensor(out, dtype=torch.float64)


def _close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual.to(torch.float64), expected, atol=atol, rtol=1e-6)


def _random_inputs(batch, length, vocab, seed, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    logits = scale * torch.randn(batch, length, vocab, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, vocab, (batch, length), generator=g)
    return logits, tokens


# ---------------------------------------------------------------------------------------------
# Hand-computed literal cases
# ---------------------------------------------------------------------------------------------

# Position 0: logits [0, ln2, ln3] -> exp = 1, 2, 3 (sum 6) -> p = 1/6, 1/3, 1/2.
# Position 1: logits [1, 1, 1] (uniform) -> p = 1/3 each, at any temperature.
_LOGITS = torch.tensor([[[0.0, LN2, LN3], [1.0, 1.0, 1.0]]], dtype=torch.float64)


def test_logprobs_hand_computed():
    tokens = torch.tensor([[2, 0]])
    # log p(token 2) = log(1/2) = -0.693147...; uniform: log(1/3) = -1.098612...
    expected = torch.tensor([[-LN2, -LN3]], dtype=torch.float64)
    _close(logprobs_from_logits(_LOGITS, tokens), expected, atol=1e-12)


def test_logprobs_temperature_hand_computed():
    # T = 2: logits/2 = [0, ln2/2, ln3/2] -> exp = 1, sqrt2, sqrt3 (sum 4.146264...)
    # token 2: ln(sqrt3) - ln(1 + sqrt2 + sqrt3) = 0.549306 - 1.422208 = -0.872902 (to 6 dp)
    # token 1: ln(sqrt2) - ln(...)              = 0.346574 - 1.422208 = -1.075634
    # uniform row stays log(1/3).
    expected_tok2 = -0.8729016327074027
    expected_tok1 = -1.075634186761485
    lp = logprobs_from_logits(_LOGITS, torch.tensor([[2, 0]]), temperature=2.0)
    _close(lp, torch.tensor([[expected_tok2, -LN3]], dtype=torch.float64), atol=1e-9)
    lp = logprobs_from_logits(_LOGITS, torch.tensor([[1, 2]]), temperature=2.0)
    _close(lp, torch.tensor([[expected_tok1, -LN3]], dtype=torch.float64), atol=1e-9)


def test_entropy_hand_computed():
    # p = 1/6, 1/3, 1/2: H = (1/6)ln6 + (1/3)ln3 + (1/2)ln2
    #                      = 0.298627 + 0.366204 + 0.346574 = 1.011404
    # uniform over 3: H = ln3 = 1.098612
    expected = torch.tensor([[1.0114042647073518, LN3]], dtype=torch.float64)
    _close(entropy_from_logits(_LOGITS), expected, atol=1e-9)


def test_scale_logits_hand_computed():
    # [0, ln2, ln3] / 2 = [0, 0.346574, 0.549306]; [1, 1, 1] / 2 = 0.5 each. bf16 logits are
    # upcast BEFORE the division: bf16(1.0) / 0.7 = 1.428571... in float32, where a bf16
    # quotient would round to 1.4296875.
    _close(scale_logits(_LOGITS, 2.0), _LOGITS / 2, atol=0.0)
    scaled = scale_logits(torch.ones(1, 1, 2, dtype=torch.bfloat16), 0.7)
    assert scaled.dtype == torch.float32
    assert scaled[0, 0, 0].item() == pytest.approx(1 / 0.7, rel=1e-7)


def test_logprobs_and_entropy_hand_computed():
    # T = 2 at position 0: p = (1, sqrt2, sqrt3) / 4.146264 = (0.241180, 0.341081, 0.417738);
    # token 2's log p as in test_logprobs_temperature_hand_computed (-0.872902), and
    # H = 0.241180*1.422208 + 0.341081*1.075634 + 0.417738*0.872902
    #   = 0.343008 + 0.366878 + 0.364646 = 1.074532 (above the T = 1 entropy 1.011404).
    # Position 1 is uniform at any temperature: log p = -ln3, H = ln3.
    lp, h = logprobs_and_entropy(_LOGITS, torch.tensor([[2, 0]]), 2.0)
    _close(lp, torch.tensor([[-0.8729016327074027, -LN3]], dtype=torch.float64), atol=1e-9)
    _close(h, torch.tensor([[1.0745321119099565, LN3]], dtype=torch.float64), atol=1e-9)


# ---------------------------------------------------------------------------------------------
# Reference comparisons
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_logprobs_match_reference(seed, temperature):
    logits, tokens = _random_inputs(3, 5, 7, seed)
    out = logprobs_from_logits(logits, tokens, temperature=temperature)
    assert out.shape == (3, 5)
    _close(out, ref_logprobs(logits, tokens, temperature))


@pytest.mark.parametrize("seed", SEEDS)
def test_entropy_matches_reference(seed):
    logits, _ = _random_inputs(3, 5, 7, seed)
    out = entropy_from_logits(logits)
    assert out.shape == (3, 5)
    _close(out, ref_entropy(logits))


def test_float32_logprobs_and_entropy_agree_with_reference():
    logits, tokens = _random_inputs(3, 5, 7, 9)
    _close(
        logprobs_from_logits(logits.float(), tokens, 0.7), ref_logprobs(logits, tokens, 0.7), 1e-5
    )
    _close(entropy_from_logits(logits.float()), ref_entropy(logits), atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.5, 0.7, 2.0])
def test_temperature_equals_dividing_logits_first(temperature):
    # The field notes' point: old, new and ref logprobs must all see logits/temperature.
    logits, tokens = _random_inputs(2, 6, 11, 4)
    _close(
        logprobs_from_logits(logits, tokens, temperature=temperature),
        logprobs_from_logits(logits / temperature, tokens).to(torch.float64),
        atol=1e-12,
    )


def test_logprobs_are_nonpositive_and_normalised():
    # Summing exp(logprob) over every possible token at a position must give 1.
    logits, _ = _random_inputs(2, 3, 5, 6)
    total = torch.zeros(2, 3, dtype=torch.float64)
    for v in range(5):
        lp = logprobs_from_logits(logits, torch.full((2, 3), v, dtype=torch.long))
        assert torch.all(lp <= 0)
        total += lp.exp()
    _close(total, torch.ones(2, 3, dtype=torch.float64), atol=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
def test_entropy_is_nonnegative_and_at_most_log_vocab(seed):
    logits, _ = _random_inputs(4, 6, 9, seed)
    h = entropy_from_logits(logits)
    assert torch.all(h >= 0)
    assert torch.all(h <= math.log(9) + 1e-9)


def test_large_logits_stay_finite_in_float32():
    # Real LM logits can span hundreds of nats; a naive p.log() underflows to log(0) = -inf
    # and 0 * -inf = nan. Entropy must stay finite in [0, log V], logprobs finite and <= 0.
    # (-1e-4 allows float32 rounding of a `logsumexp - sum(p*logits)` formula, whose two
    # terms are ~100 here; a genuinely wrong entropy is off by far more.)
    logits, tokens = _random_inputs(2, 4, 13, 8, scale=60.0)
    logits = logits.float()
    h = entropy_from_logits(logits)
    lp = logprobs_from_logits(logits, tokens)
    assert torch.isfinite(h).all() and torch.isfinite(lp).all()
    assert torch.all(h >= -1e-4) and torch.all(h <= math.log(13) + 1e-4)
    assert torch.all(lp <= 0)
    _close(h, ref_entropy(logits.double()), atol=1e-4)
    _close(lp, ref_logprobs(logits.double(), tokens), atol=1e-4)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_logprobs_and_entropy_equal_the_separate_functions(seed, temperature, dtype):
    # One log_softmax for both must give exactly what the two functions give apart, with
    # the entropy that of the tempered distribution; float32 at least, whatever came in.
    logits, tokens = _random_inputs(3, 5, 7, seed)
    logits = logits.to(dtype)
    lp, h = logprobs_and_entropy(logits, tokens, temperature)
    assert lp.dtype == h.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert torch.equal(lp, logprobs_from_logits(logits, tokens, temperature))
    assert torch.equal(h, entropy_from_logits(scale_logits(logits, temperature)))
    _close(lp, ref_logprobs(logits.double(), tokens, temperature), atol=1e-5)


def test_inputs_are_not_modified():
    logits, tokens = _random_inputs(2, 4, 6, 3)
    logits0, tokens0 = logits.clone(), tokens.clone()
    logprobs_from_logits(logits, tokens)
    logprobs_from_logits(logits, tokens, temperature=0.7)
    entropy_from_logits(logits)
    scale_logits(logits, 0.7)
    logprobs_and_entropy(logits, tokens, 0.7)
    assert torch.equal(logits, logits0)
    assert torch.equal(tokens, tokens0)
