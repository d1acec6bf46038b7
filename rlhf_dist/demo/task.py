"""The offline demo task: a tiny synthetic language of short "reviews".

Everything here is generated locally and is deterministic given a seed:

- a small grammar of reviews with positive, negative and neutral words (`sample_response`);
- a gold reward in [0, 1] (share of positive sentiment, with hidden penalties for repetition
  and a missing EOS) that the reward model is never shown directly (`gold_reward`);
- Bradley-Terry noisy preference labels on that gold reward (`bt_label`), and the accuracy a
  reward model that knew the gold reward would reach under the same noise (`bayes_accuracy`);
- a word-level tokenizer and tiny Llama configs / random-init models (`build_tokenizer`,
  `tiny_llama_config`, `build_tiny_models`);
- `write_task`, which writes the SFT, preference and prompt files of the task.

Heavy libraries (tokenizers, transformers, torch) are imported lazily inside the functions
that need them, so reward functions stay cheap to import.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import transformers

# ---------------------------------------------------------------------------------------------
# Vocabulary
# ---------------------------------------------------------------------------------------------

POSITIVE_ADJECTIVES: tuple[str, ...] = (
    "great",
    "excellent",
    "wonderful",
    "lovely",
    "superb",
    "amazing",
    "fantastic",
    "pleasant",
    "perfect",
    "brilliant",
    "delightful",
    "charming",
)
NEGATIVE_ADJECTIVES: tuple[str, ...] = (
    "awful",
    "terrible",
    "bland",
    "rude",
    "boring",
    "dirty",
    "poor",
    "horrible",
    "dull",
    "noisy",
    "mediocre",
    "disappointing",
)
POSITIVE_VERBS: tuple[str, ...] = ("loved", "enjoyed", "adored")
NEGATIVE_VERBS: tuple[str, ...] = ("hated", "disliked", "despised")

POSITIVE: tuple[str, ...] = POSITIVE_ADJECTIVES + POSITIVE_VERBS
NEGATIVE: tuple[str, ...] = NEGATIVE_ADJECTIVES + NEGATIVE_VERBS
CATEGORIES: tuple[str, ...] = ("movie", "restaurant", "hotel", "book", "phone", "concert")

NOUNS: dict[str, tuple[str, ...]] = {
    "movie": ("plot", "acting", "music", "ending", "cast"),
    "restaurant": ("food", "staff", "service", "menu", "dessert"),
    "hotel": ("room", "staff", "bed", "view", "pool"),
    "book": ("plot", "story", "writing", "ending", "hero"),
    "phone": ("screen", "battery", "camera", "design", "price"),
    "concert": ("music", "band", "sound", "crowd", "venue"),
}
INTENSIFIERS: tuple[str, ...] = ("very", "really", "quite", "truly")
TAILS: tuple[str, ...] = (
    "that is all",
    "i went last week",
    "i went with friends",
    "it was my first time",
)
PROMPT_TEMPLATES: tuple[str, ...] = (
    "review of the {} :",
    "write a review of the {} :",
    "your review of the {} :",
    "a short review of the {} :",
)
QUALIFIERS: tuple[str, ...] = ("", "new", "old", "local", "big", "small", "famous")
SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<eos>", "<bos>", "<unk>")

_POS_SET = frozenset(POSITIVE)
_NEG_SET = frozenset(NEGATIVE)
_SENTIMENT_SET = _POS_SET | _NEG_SET


def all_words() -> list[str]:
    """Every word the grammar (prompts and responses) can produce, sorted, without specials."""
    words: set[str] = set(POSITIVE) | set(NEGATIVE) | set(CATEGORIES) | set(INTENSIFIERS)
    words |= {n for nouns in NOUNS.values() for n in nouns}
    words |= {q for q in QUALIFIERS if q}
    for text in (*TAILS, *PROMPT_TEMPLATES):
        words |= set(text.replace("{}", " ").split())
    words |= {"the", "was", "is", "i", "and", "but", ",", "."}
    return sorted(words)


# ---------------------------------------------------------------------------------------------
# Prompts and responses
# ---------------------------------------------------------------------------------------------


def _format_prompt(template: str, qualifier: str, category: str) -> str:
    """Fill a prompt template with an optional qualifier and a category."""
    subject = f"{qualifier} {category}" if qualifier else category
    return template.format(subject)


def make_prompt(rng: random.Random) -> tuple[str, str]:
    """Return (prompt, category); the prompt looks like 'review of the hotel :' (ends with ' :')."""
    template = rng.choice(PROMPT_TEMPLATES)
    qualifier = rng.choice(QUALIFIERS)
    category = rng.choice(CATEGORIES)
    return _format_prompt(template, qualifier, category), category


def prompt_pools() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """All distinct (prompt, category) pairs, split deterministically into (train, held-out).

    About one in five combinations is held out; every template, qualifier and category still
    occurs in the training pool.
    """
    train: list[tuple[str, str]] = []
    held_out: list[tuple[str, str]] = []
    for ti, template in enumerate(PROMPT_TEMPLATES):
        for qi, qualifier in enumerate(QUALIFIERS):
            for ci, category in enumerate(CATEGORIES):
                item = (_format_prompt(template, qualifier, category), category)
                (held_out if (ti + qi + ci) % 5 == 0 else train).append(item)
    return train, held_out


def _clause(rng: random.Random, noun: str, positive: bool, used: set[str]) -> list[str]:
    """One clause with exactly one sentiment slot, using a sentiment word not in `used`."""
    kind = rng.randrange(5)
    pool = POSITIVE_VERBS if positive else NEGATIVE_VERBS
    if kind != 4:
        pool = POSITIVE_ADJECTIVES if positive else NEGATIVE_ADJECTIVES
    word = rng.choice([w for w in pool if w not in used] or list(pool))
    used.add(word)
    if kind == 0:
        return ["the", noun, "was", word]
    if kind == 1:
        return ["the", noun, "was", rng.choice(INTENSIFIERS), word]
    if kind == 2:
        return ["the", noun, "is", word]
    if kind == 3:
        return [word, noun]
    return ["i", word, "the", noun]


def sample_response(rng: random.Random, category: str, pos_share: float) -> str:
    """A short review of 2-4 clauses (6-20 words) from the grammar.

    Each clause has one sentiment slot, positive with probability `pos_share`; sentiment words
    are not repeated within a response. Clauses about the same sentiment are joined with
    'and'/',', a change of sentiment with 'but'/'.'. An optional neutral tail may follow.
    Never the same word twice in a row.
    """
    nouns = rng.sample(NOUNS[category], rng.randint(2, 4))
    used: set[str] = set()
    words: list[str] = []
    prev_positive = None
    for noun in nouns:
        positive = rng.random() < pos_share
        joiner = rng.choice(("and", ",") if positive == prev_positive else ("but", "."))
        clause = _clause(rng, noun, positive, used)
        if prev_positive is not None:
            if len(words) + 1 + len(clause) > 20:
                break
            words.append(joiner)
        words += clause
        prev_positive = positive
    tail = rng.choice(TAILS).split()
    if len(words) < 6 or (rng.random() < 0.4 and len(words) + 1 + len(tail) <= 20):
        words += [".", *tail]
    assert all(a != b for a, b in pairwise(words)), words
    return " ".join(words)


# ---------------------------------------------------------------------------------------------
# Gold reward and reward functions
# ---------------------------------------------------------------------------------------------


def gold_reward(response: str, finished: bool = True) -> float:
    """Gold reward in [0, 1] of one response.

    Base = pos / (pos + neg) over sentiment words (0.5 if none). Hidden penalties: minus
    0.5 * (share of adjacent word pairs that are identical) and minus 0.25 * (share of words
    that repeat a sentiment word seen earlier in the response); times 0.5 if the response
    did not end with EOS (`finished=False`); an empty response scores 0. Clamped to [0, 1].
    """
    words = response.lower().split()
    if not words:
        return 0.0
    pos = sum(w in _POS_SET for w in words)
    neg = sum(w in _NEG_SET for w in words)
    base = pos / (pos + neg) if pos + neg else 0.5
    pairs = len(words) - 1
    adjacent = sum(a == b for a, b in pairwise(words)) / pairs if pairs else 0.0
    seen: set[str] = set()
    repeats = 0
    for w in words:
        if w in _SENTIMENT_SET:
            repeats += w in seen
            seen.add(w)
    reward = base - 0.5 * adjacent - 0.25 * repeats / len(words)
    if not finished:
        reward *= 0.5
    return min(1.0, max(0.0, reward))


def gold_rewards(responses: list[str], finished: list[bool] | None = None) -> list[float]:
    """`gold_reward` over a list; `finished` defaults to all True."""
    if finished is None:
        finished = [True] * len(responses)
    if len(finished) != len(responses):
        raise ValueError("responses and finished must have the same length")
    return [gold_reward(r, f) for r, f in zip(responses, finished, strict=True)]


def gold_reward_fn(prompts: list[str], responses: list[str]) -> list[float]:
    """Reward-function interface `module:callable(prompts, responses)`; assumes finished=True."""
    del prompts
    return gold_rewards(responses)


def gold_reward_eval(prompts: list[str], responses: list[str], finished: list[bool]) -> list[float]:
    """The gold reward in the oracle interface of `rlhf-dist eval` (eval.gold_function)."""
    return gold_rewards(responses, finished)


def positive_word_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """Example reward: (#distinct POSITIVE words - #NEGATIVE words) / 4, clamped to [-1, 1]."""
    del prompts
    out = []
    for response in responses:
        words = response.lower().split()
        score = (len(_POS_SET.intersection(words)) - sum(w in _NEG_SET for w in words)) / 4
        out.append(min(1.0, max(-1.0, score)))
    return out


def _sigmoid(x: float) -> float:
    """Numerically stable logistic function."""
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    z = math.exp(x)
    return z / (1.0 + z)


def bt_label(rng: random.Random, gold_a: float, gold_b: float, beta: float) -> bool:
    """Bradley-Terry noisy label: True (a preferred) with probability sigmoid(beta*(a - b))."""
    return rng.random() < _sigmoid(beta * (gold_a - gold_b))


def bayes_accuracy(gold_chosen: list[float], gold_rejected: list[float], beta: float) -> float:
    """Expected accuracy of a gold-knowing reward model under the same BT noise.

    Mean over pairs of sigmoid(beta * |gold_a - gold_b|); ties count 0.5.
    """
    if len(gold_chosen) != len(gold_rejected):
        raise ValueError("gold_chosen and gold_rejected must have the same length")
    if not gold_chosen:
        return float("nan")
    probs = [_sigmoid(beta * abs(a - b)) for a, b in zip(gold_chosen, gold_rejected, strict=True)]
    return sum(probs) / len(probs)


# ---------------------------------------------------------------------------------------------
# Task files
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskFiles:
    """Paths of a generated demo task (see `write_task`)."""

    root: Path
    tokenizer_dir: Path
    sft: Path
    prefs_train: Path
    prefs_eval: Path
    prompts: Path
    eval_prompts: Path

    @classmethod
    def at(cls, root: str | Path) -> TaskFiles:
        """The file layout under `root` (files need not exist yet)."""
        root = Path(root)
        return cls(
            root=root,
            tokenizer_dir=root / "tokenizer",
            sft=root / "sft.jsonl",
            prefs_train=root / "prefs_train.jsonl",
            prefs_eval=root / "prefs_eval.jsonl",
            prompts=root / "prompts.jsonl",
            eval_prompts=root / "eval_prompts.jsonl",
        )


def _write_jsonl(path: Path, rows: Iterable[dict]) -> None:
    """Write rows as JSON lines (UTF-8, '\\n' line ends, deterministic)."""
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def _sft_rows(rng: random.Random, pool: list[tuple[str, str]], n: int) -> list[dict]:
    """SFT rows; pos_share ~ U(0, 1) per response, so the data is not aligned."""
    rows = []
    for _ in range(n):
        prompt, category = rng.choice(pool)
        rows.append({"prompt": prompt, "response": sample_response(rng, category, rng.random())})
    return rows


def _pref_rows(rng: random.Random, pool: list[tuple[str, str]], n: int, beta: float) -> list[dict]:
    """Preference rows: two independent responses to one prompt, labelled by `bt_label`."""
    rows = []
    for _ in range(n):
        prompt, category = rng.choice(pool)
        a = sample_response(rng, category, rng.random())
        b = sample_response(rng, category, rng.random())
        ga, gb = gold_reward(a), gold_reward(b)
        if not bt_label(rng, ga, gb, beta):
            a, b, ga, gb = b, a, gb, ga
        rows.append(
            {
                "prompt": prompt,
                "chosen": a,
                "rejected": b,
                "category": category,
                "chosen_gold": ga,
                "rejected_gold": gb,
            }
        )
    return rows


def _prompt_rows(rng: random.Random, pool: list[tuple[str, str]], n: int) -> list[dict]:
    """Prompt rows {"prompt", "category"} drawn from `pool`."""
    rows = []
    for _ in range(n):
        prompt, category = rng.choice(pool)
        rows.append({"prompt": prompt, "category": category})
    return rows


def write_task(
    root: str | Path,
    seed: int = 0,
    n_sft: int = 2000,
    n_pref: int = 3000,
    n_pref_eval: int = 500,
    n_prompts: int = 1024,
    n_eval_prompts: int = 128,
    beta: float = 10.0,
) -> TaskFiles:
    """Generate every file of the task under `root` (created if needed); deterministic in seed.

    SFT, training preference pairs and PPO prompts use the training prompt pool; the held-out
    eval prompts and eval preference pairs use the held-out pool (see `prompt_pools`). Each file
    has its own random stream, so changing one count does not change the other files.
    """
    files = TaskFiles.at(root)
    files.root.mkdir(parents=True, exist_ok=True)
    build_tokenizer(files.tokenizer_dir)
    train_pool, held_out = prompt_pools()

    def rng(name: str) -> random.Random:
        return random.Random(f"rlhf_dist.demo/{seed}/{name}")

    _write_jsonl(files.sft, _sft_rows(rng("sft"), train_pool, n_sft))
    _write_jsonl(files.prefs_train, _pref_rows(rng("prefs_train"), train_pool, n_pref, beta))
    _write_jsonl(files.prefs_eval, _pref_rows(rng("prefs_eval"), held_out, n_pref_eval, beta))
    _write_jsonl(files.prompts, _prompt_rows(rng("prompts"), train_pool, n_prompts))
    _write_jsonl(files.eval_prompts, _prompt_rows(rng("eval_prompts"), held_out, n_eval_prompts))
    meta = {
        "seed": seed,
        "beta": beta,
        "n_sft": n_sft,
        "n_pref": n_pref,
        "n_pref_eval": n_pref_eval,
        "n_prompts": n_prompts,
        "n_eval_prompts": n_eval_prompts,
    }
    (files.root / "task.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return files


# ---------------------------------------------------------------------------------------------
# Tokenizer and models
# ---------------------------------------------------------------------------------------------


def build_tokenizer(save_dir: str | Path) -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over every word of the grammar, saved in HF format to `save_dir`.

    Ids: '<pad>'=0, '<eos>'=1, '<bos>'=2, '<unk>'=3, then the sorted words (deterministic).
    Whitespace-split pre-tokenizer, no post-processor (encode adds no special tokens), decoding
    joins words with single spaces. padding_side is 'right'.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *all_words()))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        padding_side="right",
        clean_up_tokenization_spaces=False,
        model_max_length=128,
    )
    Path(save_dir).mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(save_dir))
    return tokenizer


def tiny_llama_config(
    vocab_size: int,
    pad_token_id: int,
    bos_token_id: int,
    eos_token_id: int,
    size: str = "tiny",
) -> transformers.LlamaConfig:
    """A from-scratch Llama config: 'tiny' (64 hidden, 2 layers) or 'small' (128, 4 layers).

    Dropout is 0 everywhere and input/output embeddings are not tied.
    """
    from transformers import LlamaConfig

    sizes = {
        # Heads of 32 dimensions (2 query heads sharing 1 key/value head): vLLM's CPU
        # attention takes head sizes from 32 up, and the weight shapes are those of 4 x 16.
        "tiny": dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=256,
        ),
        "small": dict(
            hidden_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            intermediate_size=512,
        ),
    }
    if size not in sizes:
        raise ValueError(f"size must be one of {sorted(sizes)}, got {size!r}")
    return LlamaConfig(
        vocab_size=vocab_size,
        max_position_embeddings=128,
        attention_dropout=0.0,
        mlp_bias=False,
        attention_bias=False,
        tie_word_embeddings=False,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        **sizes[size],
    )


def build_tiny_models(
    out_dir: str | Path,
    tokenizer: transformers.PreTrainedTokenizerBase,
    size: str = "tiny",
    seed: int = 0,
    moe: bool = False,
) -> dict[str, Path]:
    """Random-init a policy (LlamaForCausalLM) and a reward model (LlamaForSequenceClassification,
    num_labels=1), save each with the tokenizer (safetensors) under out_dir/policy and
    out_dir/reward, and return {'policy': path, 'reward': path}. moe: the policy a
    Qwen3-MoE of the same width whose MLPs are 4 experts of a quarter of the dense width,
    2 per token (docs/moe.md).
    """
    import torch
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    config = tiny_llama_config(
        len(tokenizer),
        tokenizer.pad_token_id,
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        size=size,
    )
    torch.manual_seed(seed)
    policy = tiny_moe_policy(config) if moe else LlamaForCausalLM(config)
    policy.generation_config.pad_token_id = tokenizer.pad_token_id
    policy.generation_config.eos_token_id = tokenizer.eos_token_id
    policy.generation_config.bos_token_id = tokenizer.bos_token_id
    rm_config = tiny_llama_config(
        len(tokenizer),
        tokenizer.pad_token_id,
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        size=size,
    )
    rm_config.num_labels = 1
    reward = LlamaForSequenceClassification(rm_config)
    paths = {}
    for name, model in (("policy", policy), ("reward", reward)):
        path = Path(out_dir) / name
        model.save_pretrained(str(path), safe_serialization=True)
        tokenizer.save_pretrained(str(path))
        paths[name] = path
    return paths


def tiny_moe_policy(dense: transformers.LlamaConfig) -> transformers.PreTrainedModel:
    """A random Qwen3MoeForCausalLM shaped as the tiny Llama `dense`: its MLP replaced by 4
    experts of a quarter of the dense width, top-2 (the active MLP is half the dense one),
    the config's own load-balancing weight (0.001)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings", "pad_token_id", "bos_token_id",
            "eos_token_id", "tie_word_embeddings")  # fmt: skip
    config = Qwen3MoeConfig(
        **{k: getattr(dense, k) for k in keys},
        head_dim=dense.hidden_size // dense.num_attention_heads,
        intermediate_size=dense.intermediate_size,
        moe_intermediate_size=dense.intermediate_size // 4,
        num_experts=4,
        num_experts_per_tok=2,
        attention_dropout=0.0,
    )
    return Qwen3MoeForCausalLM(config)
