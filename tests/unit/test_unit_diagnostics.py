"""Unit tests of rlhf_dist.diagnostics: every function on cases small enough to compute by
hand, plus the property that the reliability diagram's ECE is the trainer's ECE."""

from collections.abc import Callable, Sequence

import pytest
import torch

from rlhf_dist.observability import diagnostics as d
from rlhf_dist.observability.diagnostics import Response
from rlhf_dist.trainers.reward import expected_calibration_error

# ------------------------------------------------------------------ accuracy_by_category


def test_accuracy_by_category_by_hand():
    diffs = [1.0, -1.0, 2.0, 0.0, 0.5]
    cats = ["movie", "book", "movie", "book", None]
    out = d.accuracy_by_category(diffs, cats)
    # movie: +1, +2 -> 2/2; book: -1, 0 (a tie is wrong) -> 0/2; the None pair: "all" only.
    assert out == {
        "all": {"accuracy": 3 / 5, "pairs": 5},
        "book": {"accuracy": 0.0, "pairs": 2},
        "movie": {"accuracy": 1.0, "pairs": 2},
    }
    assert list(out) == ["all", "book", "movie"]  # categories sorted after "all"


def test_accuracy_by_category_without_categories_is_all_only():
    out = d.accuracy_by_category(torch.tensor([0.3, -0.2, 0.1, 0.4]), None)
    assert out == {"all": {"accuracy": 0.75, "pairs": 4}}


def test_accuracy_by_category_edge_cases():
    assert d.accuracy_by_category([], None) == {"all": {"accuracy": None, "pairs": 0}}
    # Non-text labels are reported under their text.
    assert d.accuracy_by_category([1.0], [3])["3"] == {"accuracy": 1.0, "pairs": 1}
    with pytest.raises(ValueError, match="2 categories for 3 pairs"):
        d.accuracy_by_category([1.0, 2.0, 3.0], ["a", "b"])


# --------------------------------------------------------------------- reliability_bins


def test_reliability_bins_by_hand():
    # confidence [0.6, 0.6, 0.9, 0.8], correct [1, 0, 1, 1] (the case of test_unit_reward_ece)
    bins = d.reliability_bins(torch.tensor([0.6, 0.4, 0.9, 0.8]), n_bins=2)
    assert [(b["lo"], b["hi"], b["pairs"]) for b in bins] == [(0.5, 0.75, 2), (0.75, 1.0, 2)]
    assert bins[0]["predicted"] == pytest.approx(0.6) and bins[0]["observed"] == 0.5
    assert bins[1]["predicted"] == pytest.approx(0.85) and bins[1]["observed"] == 1.0
    # |0.5 - 0.6| * 2/4 + |1 - 0.85| * 2/4
    assert d.ece_from_bins(bins) == pytest.approx(0.125, abs=1e-6)


def test_reliability_bins_edges_and_empty_bins():
    # p = 1 and p = 0 are confidence 1: the last bin is closed. p = 0.5 is a wrong guess at
    # confidence 0.5 (a tie), in the first bin.
    bins = d.reliability_bins(torch.tensor([1.0, 0.0, 0.5]), n_bins=4)
    assert [b["pairs"] for b in bins] == [1, 0, 0, 2]
    assert bins[0] == {"lo": 0.5, "hi": 0.625, "predicted": 0.5, "observed": 0.0, "pairs": 1}
    assert bins[1]["predicted"] is None and bins[1]["observed"] is None
    assert bins[3]["predicted"] == 1.0 and bins[3]["observed"] == 0.5  # p=0 favoured rejected
    assert d.ece_from_bins(d.reliability_bins(torch.zeros(0))) == 0.0


def _reference_ece(p: torch.Tensor, n_bins: int) -> float:
    """The trainer's original loop, kept here as an independent reference."""
    confidence = torch.maximum(p, 1 - p)
    correct = (p > 0.5).float()
    bins = torch.clamp(((confidence - 0.5) * 2 * n_bins).long(), max=n_bins - 1)
    ece = 0.0
    for b in range(n_bins):
        in_bin = bins == b
        if in_bin.any():
            gap = (correct[in_bin].mean() - confidence[in_bin].mean()).abs()
            ece += float(gap) * float(in_bin.float().mean())
    return ece


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("n_bins", [1, 3, 10])
def test_ece_of_the_reliability_diagram_is_the_trainers_ece(seed, n_bins):
    g = torch.Generator().manual_seed(seed)
    p = torch.sigmoid(3 * torch.randn(257, generator=g))
    bins = d.reliability_bins(p, n_bins)
    assert sum(b["pairs"] for b in bins) == 257
    ece = d.ece_from_bins(bins)
    assert ece == pytest.approx(expected_calibration_error(p, n_bins), abs=1e-6)
    assert ece == pytest.approx(_reference_ece(p, n_bins), abs=1e-6)
    # ECE is the pair-weighted mean gap between the diagram's two curves.
    gaps = [abs(b["observed"] - b["predicted"]) * b["pairs"] for b in bins if b["pairs"]]
    assert ece == pytest.approx(sum(gaps) / 257)


# ------------------------------------------------------------------- length_correlation


def test_length_correlation_by_hand():
    # centred x = [-1.5, -0.5, 0.5, 1.5], y = [-1.5, 0.5, -0.5, 1.5]: 4 / sqrt(5 * 5)
    assert d.length_correlation([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    assert d.length_correlation([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert d.length_correlation(torch.tensor([3.0, 2.0, 1.0]), [1, 2, 3]) == pytest.approx(-1.0)


def test_length_correlation_ignores_scale_and_shift():
    s, n = [0.3, -1.2, 2.5, 0.0, 1.1], [7, 3, 12, 9, 5]
    r = d.length_correlation(s, n)
    assert d.length_correlation([10 * x - 4 for x in s], [x + 100 for x in n]) == pytest.approx(r)


def test_length_correlation_is_zero_where_undefined():
    assert d.length_correlation([1.0, 1.0, 1.0], [3, 5, 9]) == 0.0  # constant scores
    assert d.length_correlation([0.1, 0.7, 0.3], [4, 4, 4]) == 0.0  # constant lengths
    assert d.length_correlation([0.5], [4]) == 0.0
    assert d.length_correlation([], []) == 0.0
    with pytest.raises(ValueError, match="3 scores for 2 lengths"):
        d.length_correlation([1, 2, 3], [1, 2])


# --------------------------------------------------------------------- longer_preferred


def test_longer_preferred_by_hand():
    diffs = [1.0, -1.0, 1.0, -2.0, 0.5]
    chosen = [5, 5, 3, 4, 6]
    rejected = [3, 8, 3, 2, 9]
    # Pair 3 has equal lengths: left out. Longer one: chosen, rejected, -, chosen, rejected.
    # Model picks: chosen (longer), rejected (longer), -, rejected (shorter), chosen (shorter).
    out = d.longer_preferred(diffs, chosen, rejected)
    assert out == {"model": 0.5, "labels": 0.5, "pairs": 4}
    assert d.longer_preferred([1.0], [3], [3]) == {"model": None, "labels": None, "pairs": 0}


# ------------------------------------------------------------------- rephrasing probe


def test_response_ids():
    r = Response([9, 8], [1, 2, 3], [0])
    assert r.ids() == [9, 8, 1, 2, 3, 0]
    assert r.ids([4]) == [9, 8, 4, 0]
    assert Response([9], [1], []).ids() == [9, 1]  # a response without EOS keeps none


def test_rephrasings_by_hand():
    responses = [
        Response([9], [1, 2, 5, 6], [0]),  # ends with the tail [5, 6]
        Response([9], [1, 2, 3], [0]),  # no droppable tail
        Response([9], [5, 6], [0]),  # dropping [5, 6] would leave nothing; [6] leaves [5]
        Response([9], [1, 7, 5, 6], [0]),  # both tails match: the first listed is dropped
    ]
    longer, shorter = d.rephrasings(responses, [7, 7], tails=[[5, 6], [6]])
    assert longer == [
        [9, 1, 2, 5, 6, 7, 7, 0],
        [9, 1, 2, 3, 7, 7, 0],
        [9, 5, 6, 7, 7, 0],
        [9, 1, 7, 5, 6, 7, 7, 0],
    ]
    assert shorter == [(0, [9, 1, 2, 0]), (2, [9, 5, 0]), (3, [9, 1, 7, 0])]
    assert d.rephrasings(responses, [7], tails=[[]]) == (d.rephrasings(responses, [7])[0], [])


def test_rephrase_summary_by_hand():
    out = d.rephrase_summary(
        original=[1.0, 2.0, 3.0, 4.0],
        longer=[2.0, 1.0, 3.5, 4.0],  # deltas +1, -1, +0.5, 0 (no change is no rise)
        shorter_original=[2.0, 4.0],
        shorter=[1.5, 4.5],  # original - shorter: +0.5, -0.5
    )
    assert out == {
        "responses": 4,
        "longer_delta": 0.125,
        "longer_rise": 0.5,
        "shorter_responses": 2,
        "shorter_delta": 0.0,
        "shorter_rise": 0.5,
    }
    empty = d.rephrase_summary([], [], [], [])
    assert empty["responses"] == 0 and empty["longer_delta"] is None
    assert empty["shorter_delta"] is None and empty["shorter_rise"] is None


def length_counter(seqs):
    """The degenerate reward model the probe exists to catch: score = token count."""
    return torch.tensor([float(len(s)) for s in seqs])


def content_scorer(seqs):
    """A model that reads content only: +1 per token 1 ("positive word"), -1 per token 2."""
    return torch.tensor([float(s.count(1) - s.count(2)) for s in seqs])


RESPONSES = [
    Response([9, 9], [1, 3, 1, 5, 6], [0]),
    Response([9], [2, 3], [0]),
    Response([9, 9, 9], [1, 2, 3, 4], [0]),
]


def rephrase_probe(
    score_fn: Callable[[list[list[int]]], Sequence[float]],
    responses: Sequence[Response],
    filler: list[int],
    tails: Sequence[list[int]] = (),
    scores=None,
) -> dict:
    """The whole rephrasing probe in one process: `d.rephrasings` scored by `score_fn`
    (what scoring.probe_rephrasings does with a reward model over all ranks).

    score_fn: token sequences -> (len,) scores; scores: (N,) scores of `responses` if
    already known (else they are scored too). Returns `rephrase_summary`'s dict.
    """
    if scores is None:
        scores = score_fn([r.ids() for r in responses]) if responses else []
    scores = torch.as_tensor(scores, dtype=torch.float64).reshape(-1)
    longer, shorter = d.rephrasings(responses, filler, tails)
    longer_scores = score_fn(longer) if longer else []
    shorter_scores = score_fn([s for _, s in shorter]) if shorter else []
    return d.rephrase_summary(
        scores, longer_scores, scores[[i for i, _ in shorter]], shorter_scores
    )


def test_rephrase_probe_catches_a_length_counter():
    out = rephrase_probe(length_counter, RESPONSES, filler=[5, 6], tails=[[5, 6]])
    assert out == {
        "responses": 3,
        "longer_delta": 2.0,  # two filler tokens, two more points, every time
        "longer_rise": 1.0,
        "shorter_responses": 1,
        "shorter_delta": 2.0,
        "shorter_rise": 1.0,
    }


def test_rephrase_probe_leaves_a_content_model_unmoved():
    out = rephrase_probe(content_scorer, RESPONSES, filler=[5, 6], tails=[[5, 6]])
    assert out["longer_delta"] == 0.0 and out["longer_rise"] == 0.0
    assert out["shorter_delta"] == 0.0 and out["shorter_rise"] == 0.0


def test_rephrase_probe_reuses_known_scores():
    calls = []

    def scorer(seqs):
        calls.append(len(seqs))
        return length_counter(seqs)

    out = rephrase_probe(scorer, RESPONSES, [5], scores=[0.0, 0.0, 0.0])
    assert calls == [3]  # only the longer versions were scored; no tails, no shorter ones
    # Known scores of 0 against token counts 9, 5 and 9 of the longer versions.
    assert out["longer_delta"] == pytest.approx(23 / 3) and out["shorter_responses"] == 0


class WordTokenizer:
    """A word-level tokenizer like the demo's: unknown words map to the unknown id 3."""

    unk_token_id = 3
    vocab = {".": 5, "that": 6, "is": 7, "all": 8}

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [self.vocab.get(w, 3) for w in text.split()]}


class ByteTokenizer:
    """A byte-level tokenizer: nothing is unknown (and it has no unknown id at all)."""

    unk_token_id = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": list(text.encode())}


def test_encode_filler_takes_the_first_candidate_without_unknown_tokens():
    # " That is all." has "That" and "all." unknown to the word-level tokenizer.
    assert d.encode_filler(WordTokenizer()) == (" . that is all", [5, 6, 7, 8])
    text, ids = d.encode_filler(ByteTokenizer())
    assert text == d.NEUTRAL_FILLERS[0] and bytes(ids).decode() == " That is all."
    assert d.encode_filler(WordTokenizer(), ["good bye", ""]) == ("", [])


# ------------------------------------------------------------------ length_bias_warning


def test_warning_thresholds():
    assert d.length_bias_warning(0.5) is None  # the limit itself passes
    assert "+0.51" in d.length_bias_warning(0.51)
    assert "-0.60" in d.length_bias_warning(-0.6)  # a model that punishes length is biased too
    assert d.length_bias_warning(0.1, longer_rise=0.8) is None
    assert "81%" in d.length_bias_warning(0.1, longer_rise=0.81)
    assert d.length_bias_warning(0.0, longer_rise=None) is None


def test_warning_ignores_a_consistent_but_negligible_nudge():
    # 95% of responses rose, but by 0.05 score std on average: not a length counter.
    assert d.length_bias_warning(0.0, 0.95, longer_delta=0.05, score_std=1.0) is None
    assert d.length_bias_warning(0.0, 0.95, longer_delta=0.1, score_std=1.0) is not None


def test_warning_flags_the_synthetic_length_counter_and_not_the_content_model():
    lengths = [len(r.ids()) for r in RESPONSES]
    counter = rephrase_probe(length_counter, RESPONSES, [5, 6])
    corr = d.length_correlation(length_counter([r.ids() for r in RESPONSES]), lengths)
    line = d.length_bias_warning(corr, counter["longer_rise"], counter["longer_delta"], 2.0)
    assert corr == pytest.approx(1.0)
    assert line.startswith("the reward model looks like a length counter: ")
    assert "correlation +1.00" in line and "100% of responses" in line and "\n" not in line

    # Good and bad responses at every length: content decides, length says nothing.
    balanced = [Response([9], body, [0]) for body in ([1], [2], [1, 3, 3], [2, 3, 3])]
    content = rephrase_probe(content_scorer, balanced, [5, 6])
    scores = content_scorer([r.ids() for r in balanced])
    corr = d.length_correlation(scores, [len(r.ids()) for r in balanced])
    assert corr == 0.0
    assert d.length_bias_warning(corr, content["longer_rise"], content["longer_delta"]) is None
