"""Reward-model diagnostics: accuracy by category, reliability diagram, length bias.

Pure functions over scores, lengths and token ids (torch and the standard library only),
so they are cheap to import and test. Scoring is the caller's: `rephrasings` builds the
sequences to score, `rephrase_summary` reads their scores (scoring.probe_rephrasings
runs the probe with a reward model on every rank). What each number means and the
thresholds of the length-counter warning: docs/rm_diagnostics.md.

Conventions: a preference pair's `diff` is score(chosen) - score(rejected), and the pair
counts as ranked correctly iff diff > 0 (a tie is wrong, as in `rm/accuracy`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, TypeAlias

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# A 1-D run of numbers: an (N,) tensor or a list of floats/ints.
Numbers: TypeAlias = torch.Tensor | Sequence[float]

# The warning thresholds (docs/rm_diagnostics.md). A content-driven reward model can still
# correlate with length when its data does, but beyond 0.5 length explains more than a
# quarter of the score variance: worth a look before PPO learns to pad.
LENGTH_CORR_LIMIT = 0.5
# Appending a sentence that says nothing should move scores up and down about evenly; a
# model that rewards almost every padded response (by a non-negligible amount) counts length.
LONGER_RISE_LIMIT = 0.8
# ... where "non-negligible" is a mean rise of at least this share of the score std, so a
# tiny systematic nudge from an unfamiliar ending is not mistaken for length counting.
LONGER_DELTA_MIN_STD = 0.1

# Content-free endings for the rephrasing probe, tried in order: the first one a tokenizer
# spells without its unknown token is used. "That is all." adds no information to any
# response. The second is the same sentence for word-level, lower-case tokenizers that
# split on whitespace, such as the offline demo's (its grammar already ends reviews with
# ". that is all", so there it is in-distribution and provably neutral for the gold reward).
NEUTRAL_FILLERS: tuple[str, ...] = (" That is all.", " . that is all")


def _floats(values: Numbers) -> torch.Tensor:
    """(N,) float64 tensor of a tensor or a list of numbers."""
    return torch.as_tensor(values, dtype=torch.float64).reshape(-1)


def accuracy_by_category(
    diffs: Numbers, categories: Sequence[object] | None = None
) -> dict[str, dict]:
    """Share of pairs ranked correctly, overall ("all") and per prompt category.

    diffs: (N,) chosen minus rejected score; categories: N labels or None. Returns
    {"all": {"accuracy", "pairs"}, "<category>": {...}, ...}, categories sorted by name;
    pairs whose category is None count in "all" only. Accuracy of 0 pairs is None.
    """
    diffs = _floats(diffs)
    if categories is not None and len(categories) != len(diffs):
        raise ValueError(f"{len(categories)} categories for {len(diffs)} pairs")
    correct = (diffs > 0).tolist()

    def entry(hits: list[bool]) -> dict:
        return {"accuracy": sum(hits) / len(hits) if hits else None, "pairs": len(hits)}

    out = {"all": entry(correct)}
    groups: dict[str, list[bool]] = {}
    for hit, category in zip(correct, categories or ()):
        if category is not None:
            groups.setdefault(str(category), []).append(hit)
    out |= {name: entry(groups[name]) for name in sorted(groups)}
    return out


def reliability_bins(prob_chosen: Numbers, n_bins: int = 10) -> list[dict]:
    """The reliability diagram of P(chosen preferred): predicted vs observed per bin.

    prob_chosen: (N,) sigmoid(diff). Each pair is folded to its predicted winner, as
    `expected_calibration_error` does: confidence max(p, 1 - p), correct iff p > 0.5.
    Bin b covers confidence [lo, hi) = [0.5 + b/(2 n_bins), 0.5 + (b+1)/(2 n_bins)), the
    last one closed. Returns n_bins dicts {"lo", "hi", "predicted" (mean confidence),
    "observed" (accuracy), "pairs"}; predicted/observed are None for an empty bin.
    """
    p = torch.as_tensor(prob_chosen).reshape(-1)
    confidence = torch.maximum(p, 1 - p)
    correct = (p > 0.5).to(confidence.dtype)
    index = torch.clamp(((confidence - 0.5) * 2 * n_bins).long(), max=n_bins - 1)
    bins = []
    for b in range(n_bins):
        in_bin = index == b
        n = int(in_bin.sum())
        bins.append(
            {
                "lo": 0.5 + b / (2 * n_bins),
                "hi": 0.5 + (b + 1) / (2 * n_bins),
                "predicted": float(confidence[in_bin].mean()) if n else None,
                "observed": float(correct[in_bin].mean()) if n else None,
                "pairs": n,
            }
        )
    return bins


def ece_from_bins(bins: list[dict]) -> float:
    """Expected calibration error of `reliability_bins` output: the sum over bins of
    |observed - predicted| x share of pairs in the bin (0.0 for no pairs)."""
    total = sum(b["pairs"] for b in bins)
    gaps = [abs(b["observed"] - b["predicted"]) * b["pairs"] / total for b in bins if b["pairs"]]
    return float(sum(gaps))


def length_correlation(scores: Numbers, lengths: Numbers) -> float:
    """Pearson correlation of scores (N,) with lengths (N,) in tokens.

    0.0 when it is undefined (fewer than 2 values, or either input constant): "no linear
    relation found" is the honest reading there, and JSON has no NaN.
    """
    x, y = _floats(scores), _floats(lengths)
    if len(x) != len(y):
        raise ValueError(f"{len(x)} scores for {len(y)} lengths")
    if len(x) < 2:
        return 0.0
    x, y = x - x.mean(), y - y.mean()
    denom = math.sqrt(float((x * x).sum()) * float((y * y).sum()))
    corr = float((x * y).sum()) / denom if denom > 0 else 0.0
    return max(-1.0, min(1.0, corr)) if math.isfinite(corr) else 0.0


def longer_preferred(diffs: Numbers, chosen_lengths: Numbers, rejected_lengths: Numbers) -> dict:
    """How often the longer response of a pair wins, by the model and by the labels.

    diffs, chosen_lengths, rejected_lengths: (N,). Over the pairs of unequal lengths:
    {"model": share the model scores the longer one higher, "labels": share where the
    longer one is the chosen one, "pairs": how many}. The labels' share is the data's own
    length bias, the baseline the model's share should be read against (None if no pairs).
    """
    diffs, lc, lr = _floats(diffs), _floats(chosen_lengths), _floats(rejected_lengths)
    unequal = lc != lr
    n = int(unequal.sum())
    if n == 0:
        return {"model": None, "labels": None, "pairs": 0}
    chosen_longer = (lc > lr)[unequal]
    model_picks_chosen = (diffs > 0)[unequal]
    rejected_wins = (diffs < 0)[unequal]
    model_longer = torch.where(chosen_longer, model_picks_chosen, rejected_wins)
    return {
        "model": float(model_longer.double().mean()),
        "labels": float(chosen_longer.double().mean()),
        "pairs": n,
    }


# ------------------------------------------------------------------- rephrasing probe


class Response(NamedTuple):
    """A scored sequence split for rephrasing: prompt + body + end (token ids).

    body: the response without its end marker; end: [eos] (or [] if the response has none).
    """

    prompt: list[int]
    body: list[int]
    end: list[int]

    def ids(self, body: list[int] | None = None) -> list[int]:
        """The whole sequence, optionally with another body."""
        return [*self.prompt, *(self.body if body is None else body), *self.end]


def encode_filler(
    tokenizer: PreTrainedTokenizerBase, candidates: Sequence[str] = NEUTRAL_FILLERS
) -> tuple[str, list[int]]:
    """(text, ids) of the first candidate the tokenizer encodes without an unknown token.

    An unknown token would make the probe measure the model's reaction to <unk>, not to
    length. Returns ("", []) when no candidate fits (the probe is then skipped).
    """
    unk = getattr(tokenizer, "unk_token_id", None)
    for text in candidates:
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if ids and unk not in ids:
            return text, ids
    return "", []


def rephrasings(
    responses: Sequence[Response], filler: list[int], tails: Sequence[list[int]] = ()
) -> tuple[list[list[int]], list[tuple[int, list[int]]]]:
    """Same-content rephrasings without a paraphrase model.

    LONGER: the body with `filler` (a content-free phrase's ids) appended, for every
    response. SHORTER: the body without a trailing content-free part, where it ends with
    one of `tails` (the first that matches) and something remains. Returns (longer
    sequences, one per response; [(response index, shorter sequence)]).
    """
    longer = [r.ids(r.body + list(filler)) for r in responses]
    shorter = []
    for i, r in enumerate(responses):
        for tail in tails:
            n = len(tail)
            if 0 < n < len(r.body) and r.body[-n:] == list(tail):
                shorter.append((i, r.ids(r.body[:-n])))
                break
    return longer, shorter


def rephrase_summary(
    original: Numbers, longer: Numbers, shorter_original: Numbers, shorter: Numbers
) -> dict:
    """Score changes of the rephrasings; every argument is (N,) or (M,) scores.

    original/longer: scores of the N responses and of their longer versions;
    shorter_original/shorter: of the M responses that had a droppable tail and of their
    shorter versions. Returns {"responses": N, "longer_delta": mean(longer - original),
    "longer_rise": share with longer > original, "shorter_responses": M, "shorter_delta":
    mean(original - shorter), "shorter_rise": share with original > shorter}; means and
    shares over no responses are None. Positive deltas: more length, more reward.
    """
    up = _floats(longer) - _floats(original)
    down = _floats(shorter_original) - _floats(shorter)

    def mean(x: torch.Tensor) -> float | None:
        return float(x.mean()) if len(x) else None

    return {
        "responses": len(up),
        "longer_delta": mean(up),
        "longer_rise": mean((up > 0).double()),
        "shorter_responses": len(down),
        "shorter_delta": mean(down),
        "shorter_rise": mean((down > 0).double()),
    }


def length_bias_warning(
    length_corr: float,
    longer_rise: float | None = None,
    longer_delta: float | None = None,
    score_std: float | None = None,
) -> str | None:
    """One line saying why the reward model looks like a length counter, or None.

    Flags |length_corr| > LENGTH_CORR_LIMIT, or longer_rise > LONGER_RISE_LIMIT with a
    mean rise of at least LONGER_DELTA_MIN_STD score standard deviations (when longer_delta
    and score_std are given; without them the share alone decides).
    """
    reasons = []
    if abs(length_corr) > LENGTH_CORR_LIMIT:
        reasons.append(f"score-length correlation {length_corr:+.2f} (|r| > {LENGTH_CORR_LIMIT})")
    material = (
        longer_delta is None
        or score_std is None
        or longer_delta >= LONGER_DELTA_MIN_STD * score_std
    )
    if longer_rise is not None and longer_rise > LONGER_RISE_LIMIT and material:
        reasons.append(
            f"a content-free ending raised the score of {longer_rise:.0%} of responses "
            f"(> {LONGER_RISE_LIMIT:.0%})"
        )
    if not reasons:
        return None
    return "the reward model looks like a length counter: " + "; ".join(reasons)
