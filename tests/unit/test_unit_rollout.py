"""Unit tests of the model-free parts of rlhf_dist.rollout.

EOS handling decides where the reward lands and which tokens PPO trains on (docs/architecture.md
section 3: response_mask is True up to and including the first EOS), so it is checked on
hand-made rows covering every position of the first EOS.
"""

import pytest
import torch

from rlhf_dist.demo.task import build_tokenizer
from rlhf_dist.engine.decode import decode_responses, pad_columns, truncate_after_eos
from rlhf_dist.engine.sampling import sample_categorical, sample_next, truncate_logits
from rlhf_dist.rollout import RolloutBatch
from rlhf_dist.rollout.batch import scores_with_eos_penalty, sequence_last_index

EOS, PAD = 1, 0


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


# -------------------------------------------------------------------- truncate_after_eos


def test_truncate_after_eos_by_hand():
    response_ids = torch.tensor(
        [
            [EOS, 5, 6, 7],  # EOS first: a one-token (EOS-only) response
            [5, EOS, 6, 7],  # EOS in the middle: the rest becomes PAD
            [5, 6, 7, 8],  # no EOS: everything kept, unfinished
            [5, EOS, EOS, 9],  # several EOS: only the first counts
            [5, 6, 7, EOS],  # EOS at the last position
            [5, EOS, PAD, PAD],  # already padded by generate
        ]
    )
    before = response_ids.clone()
    ids, mask, finished = truncate_after_eos(response_ids, EOS, PAD)
    assert ids.tolist() == [
        [EOS, PAD, PAD, PAD],
        [5, EOS, PAD, PAD],
        [5, 6, 7, 8],
        [5, EOS, PAD, PAD],
        [5, 6, 7, EOS],
        [5, EOS, PAD, PAD],
    ]
    T, F = True, False
    assert mask.tolist() == [
        [T, F, F, F],
        [T, T, F, F],
        [T, T, T, T],
        [T, T, F, F],
        [T, T, T, T],
        [T, T, F, F],
    ]
    assert mask.dtype == torch.bool
    assert finished.tolist() == [T, T, F, T, T, T]
    assert torch.equal(response_ids, before)  # inputs are never modified (section 3)


def test_truncate_after_eos_random_rows_match_a_loop():
    g = torch.Generator().manual_seed(0)
    response_ids = torch.randint(0, 6, (40, 9), generator=g)  # EOS=1 and PAD=0 both occur
    ids, mask, finished = truncate_after_eos(response_ids, EOS, PAD)
    for b, row in enumerate(response_ids.tolist()):
        first = row.index(EOS) if EOS in row else None
        n = len(row) if first is None else first + 1
        assert mask[b].tolist() == [t < n for t in range(len(row))]
        assert ids[b].tolist() == row[:n] + [PAD] * (len(row) - n)
        assert bool(finished[b]) == (first is not None)


# ------------------------------------------------------------------------- small helpers


def test_pad_columns():
    x = torch.tensor([[1, 2], [3, 4]])
    out = pad_columns(x, 4, 9)
    assert out.tolist() == [[1, 2, 9, 9], [3, 4, 9, 9]]
    assert out.dtype == x.dtype
    mask = pad_columns(torch.ones(2, 1, dtype=torch.bool), 3, False)
    assert mask.dtype == torch.bool and mask.tolist() == [[True, False, False]] * 2
    # Already wide enough: unchanged, never cut.
    assert pad_columns(x, 2, 9).tolist() == x.tolist()
    assert pad_columns(x, 1, 9).shape == (2, 2)


def test_scores_with_eos_penalty():
    raw = torch.tensor([0.3, -0.2, 0.9, 0.5])
    finished = torch.tensor([True, False, True, False])
    assert scores_with_eos_penalty(raw, finished, -1.0).tolist() == pytest.approx(
        [0.3, -1.0, 0.9, -1.0]
    )
    # 0.0 is a penalty, not "no penalty": only None disables it.
    assert scores_with_eos_penalty(raw, finished, 0.0).tolist() == pytest.approx(
        [0.3, 0.0, 0.9, 0.0]
    )
    assert torch.equal(scores_with_eos_penalty(raw, finished, None), raw)
    assert raw.tolist() == pytest.approx([0.3, -0.2, 0.9, 0.5])  # input untouched


def test_sequence_last_index():
    mask = torch.tensor(
        [[True, True, False], [True, True, True], [True, False, False]], dtype=torch.bool
    )
    # Position in the (P + T) sequence: prompt width plus the last True response index.
    assert sequence_last_index(4, mask).tolist() == [5, 6, 4]
    assert sequence_last_index(0, mask).tolist() == [1, 2, 0]


def test_decode_responses_drops_pad_and_eos(tok):
    vocab = tok.get_vocab()
    words = [vocab[w] for w in ["the", "food", "was", "great"]]
    eos, pad = tok.eos_token_id, tok.pad_token_id
    raw = torch.tensor(
        [
            words + [eos, vocab["awful"]],  # text after EOS must not leak in
            words[:2] + [pad] * 4,  # PAD inside a (not finished) row
            [eos] + [vocab["awful"]] * 5,  # empty response
            words + [vocab["awful"], vocab["food"]],  # no EOS: all six words
        ]
    )
    ids, mask, _ = truncate_after_eos(raw, eos, pad)
    texts = decode_responses(tok, ids, mask, eos)
    assert texts == [
        "the food was great",
        "the food",
        "",
        "the food was great awful food",
    ]


# ------------------------------------------------------------ truncate_logits / sample_next


def _kept(logits: torch.Tensor) -> list[list[int]]:
    return [torch.isfinite(row).nonzero().flatten().tolist() for row in logits]


def test_truncate_logits_hand_computed():
    # Probabilities 0.5, 0.3, 0.15, 0.05 in a shuffled vocabulary order.
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3]])
    logits = probs.log()
    assert _kept(truncate_logits(logits, 0, 1.0)) == [[0, 1, 2, 3]]  # both off
    assert _kept(truncate_logits(logits, 2, 1.0)) == [[1, 3]]
    # Nucleus: 0.5 alone reaches 0.5; 0.5 + 0.3 reaches 0.7 and 0.8; 0.95 needs three.
    assert _kept(truncate_logits(logits, 0, 0.5)) == [[1]]
    assert _kept(truncate_logits(logits, 0, 0.7)) == [[1, 3]]
    assert _kept(truncate_logits(logits, 0, 0.8)) == [[1, 3]]
    assert _kept(truncate_logits(logits, 0, 0.95)) == [[0, 1, 3]]
    assert _kept(truncate_logits(logits, 0, 0.01)) == [[1]]  # the top token always stays
    assert _kept(truncate_logits(logits, 3, 0.7)) == [[1, 3]]  # both: the smaller set
    # Kept logits are unchanged; the input is not modified.
    out = truncate_logits(logits, 2, 1.0)
    assert torch.equal(out[0, [1, 3]], logits[0, [1, 3]])
    assert torch.isfinite(logits).all()


def test_truncate_logits_ties_with_the_kth_stay():
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0]])
    assert _kept(truncate_logits(logits, 2, 1.0)) == [[0, 1, 2]]


@pytest.mark.parametrize("seed", range(5))
def test_nucleus_is_the_smallest_most_likely_set_reaching_top_p(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 50, generator=g) * 3
    top_p = float(torch.rand(1, generator=g)) * 0.98 + 0.01
    kept = torch.isfinite(truncate_logits(logits, 0, top_p))
    probs = torch.softmax(logits, -1)
    for row in range(logits.shape[0]):
        p = probs[row]
        mass = float(p[kept[row]].sum())
        smallest_kept = float(p[kept[row]].min())
        dropped = p[~kept[row]]
        assert dropped.numel() == 0 or float(dropped.max()) <= smallest_kept  # most likely first
        assert mass >= top_p - 1e-6  # reaches top_p ...
        assert mass - smallest_kept < top_p + 1e-6  # ... and would not without its last token


def test_sample_next_suppresses_eos_and_applies_temperature():
    gen = type("Gen", (), {"temperature": 0.5, "top_k": 0, "top_p": 1.0})()
    logits = torch.tensor([[0.0, 5.0, 0.0]]).repeat(4000, 1)  # EOS (id 1) is the likely one
    torch.manual_seed(0)
    assert (sample_next(logits, gen, EOS, allow_eos=False) != EOS).all()
    drawn = sample_next(logits, gen, EOS, allow_eos=True)
    # softmax([0, 10, 0]) at temperature 0.5: P(EOS) = 1 / (1 + 2 e^-10) ~ 0.99991.
    assert float((drawn == EOS).float().mean()) > 0.995
    assert torch.equal(logits[0], torch.tensor([0.0, 5.0, 0.0]))  # input untouched


@pytest.mark.parametrize("block", [256, 2, 1])
def test_sample_categorical_by_hand_and_never_a_zero_probability_entry(monkeypatch, block):
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 0.5], [0.0, 0.0, 1.0]])
    torch.manual_seed(0)
    drawn = torch.stack([sample_categorical(probs, block) for _ in range(500)])  # (500, 3)
    assert (drawn[:, 0] == 1).all() and (drawn[:, 2] == 2).all()
    assert set(drawn[:, 1].tolist()) == {0, 2}  # never the middle entry
    # blocks of no mass (of 2: [0, 0], [0, 0]) and zeros inside a block of mass
    sparse = torch.tensor([[0.0, 0.0, 0.3, 0.0, 0.0, 0.0, 0.0, 0.7, 0.0]])
    drawn = torch.cat([sample_categorical(sparse, block) for _ in range(300)])
    assert set(drawn.tolist()) == {2, 7}
    # the largest uniform reaches the last entry of mass, never the zero ones after it
    tail = torch.tensor([[0.25, 0.75, 0.0, 0.0, 0.0]])
    with monkeypatch.context() as m:
        m.setattr(torch, "rand", lambda shape, **k: torch.full(shape, 1 - 2**-53, **k))
        assert sample_categorical(tail, block).tolist() == [1]
    for bad in ([[float("nan"), 1.0]], [[0.0, 0.0]], [[float("inf"), 1.0]]):
        with pytest.raises(ValueError, match="not finite or sum to 0"):
            sample_categorical(torch.tensor(bad))


@pytest.mark.parametrize(("seed", "block"), [(0, 256), (1, 8), (2, 10), (3, 1)])
def test_sample_categorical_frequencies_match_the_probabilities(seed, block):
    """200,000 draws from a random 50-entry distribution with some zeros, in one short
    block, 6 blocks and a short one, 5 whole blocks, one entry a block: each entry's
    frequency is within 5 standard errors of its probability, zeros never drawn."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.rand(50, generator=g) ** 3
    probs[torch.randperm(50, generator=g)[:10]] = 0.0
    probs = probs / probs.sum()
    torch.manual_seed(seed)
    drawn = sample_categorical(probs.expand(200_000, 50), block)
    freq = torch.bincount(drawn, minlength=50).double() / drawn.numel()
    stderr = (probs.double() * (1 - probs.double()) / drawn.numel()).sqrt()
    assert ((freq - probs.double()).abs() <= 5 * stderr + 1e-12).all()
    assert (freq[probs == 0] == 0).all()


# ------------------------------------------------------------------ RolloutBatch.trimmed


def _batch(prompt_mask, response_mask) -> RolloutBatch:
    prompt_mask = torch.tensor(prompt_mask)
    response_mask = torch.tensor(response_mask, dtype=torch.bool)
    B, T = response_mask.shape
    per_token = torch.arange(B * T, dtype=torch.float32).reshape(B, T)
    return RolloutBatch(
        prompt_ids=torch.where(prompt_mask.bool(), 7, PAD),
        prompt_mask=prompt_mask,
        response_ids=torch.where(response_mask, 9, PAD),
        response_mask=response_mask,
        old_logprobs=per_token,
        ref_logprobs=per_token + 1,
        old_values=per_token + 2,
        scores=torch.arange(B, dtype=torch.float32),
        raw_scores=torch.arange(B, dtype=torch.float32),
        finished=torch.ones(B, dtype=torch.bool),
        entropy=per_token + 3,
    )


def test_trimmed_drops_columns_that_are_padding_in_every_row():
    batch = _batch(
        [[0, 0, 1, 1], [0, 0, 0, 1]],  # the first 2 prompt columns are padding in both rows
        [[1, 1, 0, 0, 0], [1, 1, 1, 0, 0]],  # the last 2 response columns too
    )
    trimmed, T = batch.trimmed()
    assert T == 3
    assert trimmed.prompt_mask.tolist() == [[1, 1], [0, 1]]
    assert trimmed.prompt_ids.shape == (2, 2)
    assert trimmed.response_mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    for name in ("response_ids", "old_logprobs", "ref_logprobs", "old_values", "entropy"):
        assert torch.equal(getattr(trimmed, name), getattr(batch, name)[:, :3]), name
    for name in ("scores", "raw_scores", "finished"):
        assert torch.equal(getattr(trimmed, name), getattr(batch, name)), name
    # The model's input keeps every real token, in place relative to each other.
    assert trimmed.input_ids[trimmed.attention_mask.bool()].tolist() == (
        batch.input_ids[batch.attention_mask.bool()].tolist()
    )


def test_trimmed_keeps_a_batch_without_padding_columns_whole():
    batch = _batch([[1, 1], [0, 1]], [[1, 0], [1, 1]])
    trimmed, T = batch.trimmed()
    assert trimmed is batch and T == 2
    # Rows without any real response token keep one column (the model needs one).
    empty, T = _batch([[1]], [[0, 0, 0]]).trimmed()
    assert T == 1 and empty.response_mask.shape == (1, 1)


# ------------------------------------------------------------------ several stop tokens

STOPS = (1, 7, 9)  # e.g. EOS, the template's end-of-turn token, generation.stop_token_ids


def test_truncate_after_the_first_of_several_stop_ids_by_hand():
    response_ids = torch.tensor(
        [
            [5, 7, 6, 9],  # end-of-turn first
            [5, 6, 9, 1],  # a configured stop id, then EOS: the first counts
            [5, 6, 8, 6],  # none: unfinished
        ]
    )
    ids, mask, finished = truncate_after_eos(response_ids, STOPS, PAD)
    assert ids.tolist() == [[5, 7, PAD, PAD], [5, 6, 9, PAD], [5, 6, 8, 6]]
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    assert finished.tolist() == [True, True, False]
    # The reward model's read position and the missing-EOS penalty follow from these.
    assert sequence_last_index(3, mask).tolist() == [4, 5, 6]
    assert scores_with_eos_penalty(torch.ones(3), finished, -1.0).tolist() == [1, 1, -1]


def test_decode_skips_every_stop_id(tok):
    vocab = tok.get_vocab()
    great, food = vocab["great"], vocab["food"]
    ids, mask, _ = truncate_after_eos(torch.tensor([[great, 7, food]]), STOPS, PAD)
    assert decode_responses(tok, ids, mask, STOPS) == ["great"]


def test_sample_next_suppresses_every_stop_id():
    gen = type("Gen", (), {"temperature": 1.0, "top_k": 0, "top_p": 1.0})()
    logits = torch.zeros(500, 10)
    logits[:, list(STOPS)] = 8.0  # the stop ids are by far the likeliest
    torch.manual_seed(0)
    drawn = sample_next(logits, gen, torch.tensor(STOPS), allow_eos=False)
    assert not torch.isin(drawn, torch.tensor(STOPS)).any()


class _Output(dict):
    __getattr__ = dict.__getitem__


class _Scripted(torch.nn.Module):
    """A 'model' whose next token at decode step s is script[b][s] for row b (one-hot logits)."""

    def __init__(self, script: list[list[int]], vocab: int = 12):
        super().__init__()
        self.script, self.vocab, self.step = script, vocab, 0

    def forward(self, input_ids, **kwargs):
        logits = torch.full((input_ids.shape[0], 1, self.vocab), -1e9)
        for b, row in enumerate(self.script):
            logits[b, 0, row[self.step]] = 0.0
        self.step += 1
        return _Output(logits=logits, past_key_values=None)


def test_generation_stops_at_the_first_of_several_stop_ids(tok):
    from rlhf_dist.engine.decode import generate

    script = [[5, 7, 6, 6], [5, 6, 9, 6], [5, 6, 6, 6]]
    gen = type("Gen", (), {"temperature": 1.0, "top_k": 0, "top_p": 1.0})()
    gen.max_new_tokens, gen.min_new_tokens = 4, 0
    prompt = torch.tensor([[3, 4]] * 3)
    out = generate(_Scripted(script), prompt, torch.ones_like(prompt), gen, tok, stop_ids=STOPS)
    pad = tok.pad_token_id
    assert out.tolist() == [[5, 7, pad, pad], [5, 6, 9, pad], [5, 6, 6, 6]]
    # Only the tokenizer's EOS (id 1) stops it when no stop ids are given.
    out = generate(_Scripted(script), prompt, torch.ones_like(prompt), gen, tok)
    assert out.tolist() == script
    # All rows stopped early: the loop ends without running to max_new_tokens.
    short = [[7, 6, 6, 6], [9, 6, 6, 6], [1, 6, 6, 6]]
    out = generate(_Scripted(short), prompt, torch.ones_like(prompt), gen, tok, stop_ids=STOPS)
    assert out.tolist() == [[7], [9], [1]]


def test_streams_draw_what_each_request_draws_alone():
    """sample_categorical(streams=[(generator, n)]): each stream's n rows take their
    uniforms from its own generator as the global RNG gives them to an n-row batch alone,
    so each request in a merged batch samples what it samples alone, whatever the others
    are (the rollout server's merged requests)."""
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(6, 300), dim=-1)
    requests = [(11, 1), (12, 3), (13, 2)]  # (seed, rows), in row order

    def streams(reqs):
        return [(torch.Generator().manual_seed(seed), n) for seed, n in reqs]

    merged = streams(requests)
    together = torch.stack([sample_categorical(probs, streams=merged) for _ in range(4)])
    start = 0
    for seed, n in requests:
        torch.manual_seed(seed)
        rows = probs[start : start + n]
        alone = torch.stack([sample_categorical(rows) for _ in range(4)])
        assert together[:, start : start + n].tolist() == alone.tolist()
        start += n
    # without the first request, the others draw the same
    rest = sample_categorical(probs[1:], streams=streams(requests[1:]))
    assert rest.tolist() == sample_categorical(probs, streams=streams(requests))[1:].tolist()
