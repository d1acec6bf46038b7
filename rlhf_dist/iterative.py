"""`rlhf-dist iterate`: iterative RLHF (InstructGPT's loop), R rounds of

    sample answer pairs from the current policy -> label them -> reward model on all pairs
    so far -> PPO (or any ppo.estimator) from the current policy against that reward model

in one process, each stage an ordinary run of the existing trainers with a config derived
from the iterate config (docs/iterate.md). Round k writes `<output_dir>/round-k/`:

    samples/pairs.jsonl   this round's labelled pairs (a normal preference file)
    samples/train.jsonl   every round's pairs so far: the reward model's data.train
    rm/                   `rlhf-dist rm` run directory (final/ is RM_k)
    ppo/                  `rlhf-dist ppo` run directory (final/ is pi_k)
    heldout/pairs.jsonl   labelled pairs sampled from pi_k on data.eval prompts
    eval/                 `rlhf-dist eval` of pi_k (gold reward where a gold function exists)

and `<output_dir>/iterate_state.json` records the finished stages of every round, so a
killed run resumes (`--resume auto`) at the stage it was in: finished stages are skipped,
the unfinished one is re-entered with run.resume=auto (its own checkpoints).
`<output_dir>/summary.json` holds one `rounds` entry per finished round.
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlhf_dist.config import (
    Config,
    ConfigError,
    UserError,
    config_from_dict,
    save_config,
    to_dict,
)
from rlhf_dist.data import inputs
from rlhf_dist.data.batching import stage_plan
from rlhf_dist.data.rows import load_data, preference_pairs, prompt_set
from rlhf_dist.distributed import Runtime, lockstep_map
from rlhf_dist.evaluate import eval_models, run_eval
from rlhf_dist.files import atomic_write_text
from rlhf_dist.models import (
    ValueModel,
    frozen_dtype,
    load_causal_lm,
    load_sequence_classifier,
    load_tokenizer,
    policy_stop_ids,
    tokenizer_for,
    train_dtype,
)
from rlhf_dist.rewards.judge import Prompt
from rlhf_dist.rewards.scoring import Scorer
from rlhf_dist.rollout import PromptBatch, collect_rollout
from rlhf_dist.trainers.ppo import train_ppo
from rlhf_dist.trainers.reward import evaluate_pairs, train_reward_model

STAGES = ("samples", "rm", "ppo", "eval")
STATE_FILE = "iterate_state.json"
STATE_FORMAT = 1
# RLHF_DIST_FAULT (checkpoint.maybe_fault) names a step, and every round's stages count
# their steps from 1; RLHF_DIST_FAULT_ROUND=k arms it in round k only (docs/architecture.md
# section 7).
FAULT_ROUND_ENV = "RLHF_DIST_FAULT_ROUND"


class LabellerError(UserError):
    """The labeller raised or returned something that is not a preference."""


# ----------------------------------------------------------------------------- labellers


class Labeller:
    """Who judges answer pairs: `preferences(prompts, a, b)` -> P(a preferred over b) per
    pair, each in [0, 1] (1.0 / 0.0 for a hard label), or None where the labeller does not
    apply to the pair (TRL's None: the pair is skipped and counted). The loop draws the
    label from it (`draw_labels`). A judge model is one more subclass (docs/iterate.md)."""

    name = "labeller"

    def preferences(self, prompts: list[Prompt], a: list[str], b: list[str]) -> list[float | None]:
        raise NotImplementedError


class FunctionLabeller(Labeller):
    """A user's `fn(prompt, a, b)` per pair: True / 1 = a preferred, False / 0 = b
    preferred, a float in [0, 1] = P(a preferred), or None = does not apply."""

    def __init__(self, fn: Callable[[Prompt, str, str], object], name: str) -> None:
        self.fn, self.name = fn, name

    def preferences(self, prompts: list[Prompt], a: list[str], b: list[str]) -> list[float | None]:
        out = []
        for prompt, x, y in zip(prompts, a, b, strict=True):
            try:
                value = self.fn(prompt, x, y)
            except Exception as e:
                raise LabellerError(
                    f"iterate.labeller {self.name} raised {type(e).__name__}: {e}"
                ) from e
            out.append(preference_value(value, self.name))
        return out


@dataclass(frozen=True)
class GoldLabeller(Labeller):
    """Bradley-Terry labels on a gold reward, as the demo's preference data
    (demo/task.py `bt_label`): P(a preferred) = sigmoid(beta * (gold(a) - gold(b))).
    gold_fn: `(prompts, responses, finished) -> list[float]` (eval.gold_function)."""

    gold_fn: Callable[[list[Prompt], list[str], list[bool]], Sequence[float]]
    beta: float
    name: str = "gold"

    def preferences(self, prompts: list[Prompt], a: list[str], b: list[str]) -> list[float | None]:
        done = [True] * len(a)
        gold_a, gold_b = self.gold_fn(prompts, a, done), self.gold_fn(prompts, b, done)
        return [_sigmoid(self.beta * (x - y)) for x, y in zip(gold_a, gold_b, strict=True)]


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def preference_value(value: object, name: str) -> float | None:
    """A labeller's answer as P(a preferred): a bool is a hard label, a real number must be
    in [0, 1], None means "does not apply to this pair" (skipped, counted); anything else
    is a LabellerError naming the labeller."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if isinstance(value, numbers.Real) and 0.0 <= float(value) <= 1.0:
        return float(value)
    raise LabellerError(
        f"iterate.labeller {name} returned {value!r}: expected True/False (a / b preferred) "
        "or P(a preferred) in [0, 1]"
    )


def build_labeller(cfg: Config) -> Labeller:
    """iterate.labeller: gold (eval.gold_function with Bradley-Terry noise) or a
    `module:function(prompt, a, b)` (or a `python:` spec from the API)."""
    spec = cfg.iterate.labeller
    if spec == "gold":
        gold = inputs.resolve_callable(cfg.eval.gold_function, "eval.gold_function")
        return GoldLabeller(gold, cfg.iterate.label_beta)
    fn = inputs.resolve_callable(spec, "iterate.labeller")
    return FunctionLabeller(fn, spec)


def draw_labels(probs: list[float], rng: random.Random) -> list[bool]:
    """True (a preferred) with probability p for each p in `probs`; one draw per pair in
    order, so the labels are a function of the RNG's seed (a hard 1.0 / 0.0 is exact)."""
    return [rng.random() < p for p in probs]


# ------------------------------------------------------------------------------- pairs


@dataclass(frozen=True)
class AnswerPairs:
    """Two sampled answers per prompt, in pair order; prompts as their rows gave them."""

    prompts: list[Prompt]
    a: list[str]
    b: list[str]

    def select(self, index: list[int]) -> AnswerPairs:
        """The pairs at `index`, in that order."""
        pick = [self.prompts[j] for j in index], [self.a[j] for j in index]
        return AnswerPairs(*pick, [self.b[j] for j in index])


def pair_rows(
    pairs: AnswerPairs, probs: list[float], labels: list[bool], round_: int
) -> tuple[list[dict], int]:
    """Preference rows {prompt, chosen, rejected, round, p_chosen} (docs/data.md) of the
    labelled pairs, and how many were dropped: pairs of two identical answers tell a
    reward model nothing (docs/data.md refuses them)."""
    rows, dropped = [], 0
    chosen: str | list[dict]  # a text, or an assistant turn after a conversational prompt
    rejected: str | list[dict]
    for prompt, a, b, p, a_wins in zip(pairs.prompts, pairs.a, pairs.b, probs, labels, strict=True):
        if a == b:
            dropped += 1
            continue
        chosen, rejected = (a, b) if a_wins else (b, a)
        if not isinstance(prompt, str):  # conversational prompt: answers as assistant turns
            chosen, rejected = _assistant(chosen), _assistant(rejected)
        p_chosen = p if a_wins else 1.0 - p
        rows.append(
            {
                "prompt": prompt,
                "chosen": chosen,
                "rejected": rejected,
                "round": round_,
                "p_chosen": p_chosen,
            }
        )
    return rows, dropped


def _assistant(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    """Rows as JSON lines, atomically (files.atomic_write_text)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSON-lines file (blank lines skipped)."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


# ------------------------------------------------------------------------------- state


class IterateState:
    """`<output_dir>/iterate_state.json`: {"format", "rounds": {"k": {"stages": [...],
    "entry": {...}}}}, the finished stages of each round and its summary entry, rewritten
    atomically after every stage (a kill leaves the old state or the new one)."""

    def __init__(self, path: Path, data: dict | None = None) -> None:
        self.path = path
        self.data = data or {"format": STATE_FORMAT, "rounds": {}}

    @classmethod
    def load(cls, root: Path, resume: str) -> IterateState:
        """The state of a run under `root`; resume must be "auto" where one exists."""
        path = root / STATE_FILE
        if not path.is_file():
            return cls(path)
        if resume != "auto":
            raise ConfigError(
                f"run.resume: {str(root)!r} already holds an iterate run ({STATE_FILE}); "
                "continue it with --resume auto, or choose another run.output_dir"
            )
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("format") != STATE_FORMAT:
            raise ConfigError(f"run.resume: {path} has format {data.get('format')}")
        return cls(path, data)

    def _round(self, k: int) -> dict:
        return self.data["rounds"].setdefault(str(k), {"stages": [], "entry": None})

    def done(self, k: int, stage: str) -> bool:
        return stage in self._round(k)["stages"]

    def stages(self, k: int) -> list[str]:
        return list(self._round(k)["stages"])

    def entry(self, k: int) -> dict | None:
        return self._round(k)["entry"]

    def finish(self, k: int, stage: str, entry: dict | None = None, write: bool = True) -> None:
        """Record `stage` of round k as done (and its entry); `write`: the main process
        writes the file, every rank keeps the record."""
        r = self._round(k)
        r["stages"] = [*r["stages"], stage]
        if entry is not None:
            r["entry"] = entry
        if write:
            atomic_write_text(self.path, json.dumps(self.data, indent=2) + "\n")


# ---------------------------------------------------------------------- stage configs


@dataclass(frozen=True)
class Layout:
    """Where round k's pieces live under the iterate run's output_dir."""

    root: Path

    def round_dir(self, k: int) -> Path:
        return self.root / f"round-{k}"

    def new_pairs(self, k: int) -> Path:
        return self.round_dir(k) / "samples" / "pairs.jsonl"

    def train_pairs(self, k: int) -> Path:
        return self.round_dir(k) / "samples" / "train.jsonl"

    def heldout(self, k: int) -> Path:
        return self.round_dir(k) / "heldout" / "pairs.jsonl"

    def rm(self, k: int) -> Path:
        return self.round_dir(k) / "rm" / "final"

    def policy(self, cfg: Config, k: int) -> str:
        """pi_k: round k's PPO result; pi_0 is model.policy (the SFT policy)."""
        return str(self.round_dir(k) / "ppo" / "final") if k else cfg.model.policy


def stage_config(cfg: Config, layout: Layout, k: int, stage: str) -> Config:
    """The config of round k's `stage` ("rm", "ppo", "eval"): the iterate config with
    output_dir, seed, resume and the models and data that chain the stages replaced (a new
    frozen Config; nothing is mutated). An unfinished stage is always entered with
    run.resume=auto: with no checkpoint yet that is a fresh start."""
    tree = to_dict(cfg)
    tree["run"] |= {
        "output_dir": str(layout.round_dir(k) / stage),
        "seed": cfg.run.seed + k - 1,
        "resume": "auto",
        # run.push_to_hub: the last round's policy is the product; one repo gets it once.
        "push_to_hub": cfg.run.push_to_hub and stage == "ppo" and k == cfg.iterate.rounds,
    }
    model, data = tree["model"], tree["data"]
    if stage == "rm":
        previous = str(layout.rm(k - 1)) if k > 1 else cfg.model.reward
        model["reward"] = previous if cfg.iterate.rm_init == "continue" else ""
        data |= {"train": str(layout.train_pairs(k)), "eval": ""}
    elif stage == "ppo":
        model |= {"policy": layout.policy(cfg, k - 1), "reward": str(layout.rm(k))}
    else:
        model |= {"policy": layout.policy(cfg, k), "reward": str(layout.rm(k))}
        tree["eval"]["reference"] = cfg.eval.reference or cfg.model.policy
        tree["run"]["resume"] = ""  # eval has no checkpoints
    return config_from_dict(tree)


@contextlib.contextmanager
def fault_armed(k: int) -> Iterator[None]:
    """RLHF_DIST_FAULT as set, unless RLHF_DIST_FAULT_ROUND names another round than k:
    then hidden for the span of round k."""
    wanted = os.environ.get(FAULT_ROUND_ENV)
    fault = os.environ.get("RLHF_DIST_FAULT")
    if not wanted or fault is None or int(wanted) == k:
        yield
        return
    del os.environ["RLHF_DIST_FAULT"]
    try:
        yield
    finally:
        os.environ["RLHF_DIST_FAULT"] = fault


# ---------------------------------------------------------------------------- sampling


def _no_scores(
    prompts: Sequence[Prompt], responses: Sequence[str], columns: list[dict] | None = None
) -> torch.Tensor:
    """The rollout path scores every response; pairs are judged by the labeller instead."""
    return torch.zeros(len(responses))


@torch.no_grad()
def sample_pairs(
    cfg: Config, runtime: Runtime, policy_path: str, which: str, n: int, seed: int
) -> tuple[AnswerPairs, int]:
    """n answer pairs from the policy at policy_path, two samples per prompt at
    generation.temperature, on the prompts of data.<which> (pair i takes prompt i mod count),
    through `rlhf-dist eval`'s generation path (evaluate.eval_models ->
    rollout.collect_rollout). Each rank samples every world_size-th pair, in chunks of
    eval.batch_size prompts in lock-step (distributed/lockstep.py); the pairs are gathered
    on every rank in order. A pair with an unfinished answer (no EOS) is dropped: a
    preference row's answers are closed with EOS when the reward model reads them.
    Returns (AnswerPairs, dropped count)."""

    m, tokenizer = cfg.model, tokenizer_for(cfg, "policy")
    where = f"data.{which} {getattr(cfg.data, which)!r}"
    prompts = prompt_set(load_data(cfg.data, which), tokenizer, cfg.data, where)
    with runtime.local_loading():
        policy = load_causal_lm(policy_path, "model.policy", train_dtype(m), m)
    policy = runtime.prepare_frozen(policy, "replicate")
    stops = policy_stop_ids(cfg, tokenizer)
    models = eval_models(policy, None, Scorer(reward_fn=_no_scores), stops, perf=cfg.perf)
    count = len(prompts.ids)

    def forward(chunk: list[int]) -> list[tuple[int, str, str, bool]]:
        rows = [j % count for j in chunk for _ in (0, 1)]  # the two samples side by side
        pair = PromptBatch.of(prompts, rows, tokenizer.pad_token_id, runtime.device)
        batch, answers = collect_rollout(models, pair, cfg, tokenizer, micro_batch_size=len(rows))
        done = batch.finished.tolist()
        return [
            (j, answers[2 * i], answers[2 * i + 1], done[2 * i] and done[2 * i + 1])
            for i, j in enumerate(chunk)
        ]

    runtime.seed_per_rank(seed)
    mine = list(range(runtime.rank, n, runtime.world_size))
    chunks = lockstep_map(runtime, mine, cfg.eval.batch_size, forward, [0])
    found = sorted(runtime.gather_objects([p for chunk in chunks for p in chunk]))
    kept = [(j, a, b) for j, a, b, finished in found if finished]
    pairs = AnswerPairs(
        [prompts.texts[j % count] for j, _, _ in kept],
        [a for _, a, _ in kept],
        [b for *_, b in kept],
    )
    return pairs, len(found) - len(kept)


def label_and_write(
    runtime: Runtime, labeller: Labeller, pairs: AnswerPairs, path: Path, k: int, seed: int
) -> dict:
    """Label the pairs and write them as a preference file at `path` (main process only;
    every rank waits for the file). Returns {"pairs", "dropped_identical", "skipped_pairs",
    "p_chosen_mean"}; skipped_pairs: those the labeller did not apply to (None)."""
    info: dict[str, Any] = {}
    if runtime.is_main:
        answers = labeller.preferences(pairs.prompts, pairs.a, pairs.b)
        if len(answers) != len(pairs.a):
            raise LabellerError(
                f"iterate.labeller {labeller.name} returned {len(answers)} preferences for "
                f"{len(pairs.a)} pairs"
            )
        found = [preference_value(p, labeller.name) for p in answers]
        keep = [j for j, p in enumerate(found) if p is not None]
        probs = [p for p in found if p is not None]
        labels = draw_labels(
            probs, random.Random(f"rlhf_dist.iterate/{seed}/{k}/{path.parent.name}")
        )
        rows, dropped = pair_rows(pairs.select(keep), probs, labels, k)
        write_jsonl(path, rows)
        mean = sum(r["p_chosen"] for r in rows) / len(rows) if rows else None
        skipped = len(found) - len(keep)
        info = {"pairs": len(rows), "dropped_identical": dropped, "skipped_pairs": skipped}
        info["p_chosen_mean"] = mean
    runtime.barrier()
    return info


# ----------------------------------------------------------------------------- scoring


@torch.no_grad()
def rm_accuracy(cfg: Config, runtime: Runtime, rm_path: Path, pairs_path: Path) -> float:
    """Share of the labelled pairs at pairs_path whose chosen answer the reward model at
    rm_path scores strictly higher (a tie is wrong: algo.losses.pairwise_reward_loss),
    scored by the reward-model trainer's own held-out evaluation (trainers/reward.py
    `evaluate_pairs`: every rank its strided share in lock-step)."""

    m = cfg.model
    tokenizer = load_tokenizer(m.tokenizer or str(rm_path), m.trust_remote_code, "model.reward")
    rows = read_jsonl(pairs_path)
    pairs = preference_pairs(rows, tokenizer, cfg.data, cfg.rm.responses_field, str(pairs_path))[0]
    with runtime.local_loading():
        net = load_sequence_classifier(str(rm_path), "model.reward", frozen_dtype(m), m)
    model = runtime.prepare_frozen(ValueModel(net, cfg.perf), "replicate")
    metrics, _ = evaluate_pairs(
        runtime,
        model,
        pairs,
        stage_plan(cfg.rm, runtime.world_size).micro_batch_size,
        tokenizer.pad_token_id,
    )
    return metrics["accuracy"]


# ------------------------------------------------------------------------------ rounds


@dataclass
class Loop:
    """What every stage of the loop reads."""

    cfg: Config
    runtime: Runtime
    layout: Layout
    state: IterateState
    labeller: Labeller


def samples_stage(loop: Loop, k: int) -> dict:
    """Round k's new pairs from pi_{k-1} on data.train prompts, labelled, and the RM's
    training file: every round's pairs so far."""
    cfg, lay = loop.cfg, loop.layout
    n, seed = cfg.iterate.pairs_per_round, cfg.run.seed + k - 1
    pairs, unfinished = sample_pairs(cfg, loop.runtime, lay.policy(cfg, k - 1), "train", n, seed)
    info = label_and_write(loop.runtime, loop.labeller, pairs, lay.new_pairs(k), k, seed)
    if loop.runtime.is_main:
        rows = [r for j in range(1, k + 1) for r in read_jsonl(lay.new_pairs(j))]
        write_jsonl(lay.train_pairs(k), rows)
        info |= {"rm_train_pairs": len(rows)}
    loop.runtime.barrier()
    return {"new_pairs": info.get("pairs"), "dropped_unfinished": unfinished, **info}


def eval_stage(loop: Loop, k: int) -> dict:
    """Round k's figures: held-out pairs from pi_k labelled, RM_k's accuracy on them and on
    pi_{k-1}'s held-out pairs, and `rlhf-dist eval` of pi_k (gold reward, score, KL)."""

    cfg, lay, runtime = loop.cfg, loop.layout, loop.runtime
    seed = cfg.run.seed + 7919 * k  # its own stream: not the training prompts' samples
    pairs, _ = sample_pairs(
        cfg,
        runtime,
        lay.policy(cfg, k),
        "eval",
        cfg.iterate.heldout_pairs,
        seed,
    )
    held = label_and_write(runtime, loop.labeller, pairs, lay.heldout(k), k, seed)
    entry = {
        "round": k,
        "rm_accuracy_on_this_policy": rm_accuracy(cfg, runtime, lay.rm(k), lay.heldout(k)),
    }
    if k > 1:
        entry["rm_accuracy_on_previous_policy"] = rm_accuracy(
            cfg, runtime, lay.rm(k), lay.heldout(k - 1)
        )
    ev = run_eval(stage_config(cfg, lay, k, "eval"), runtime)
    if cfg.eval.gold_function:
        entry["gold_reward"] = ev["gold_reward"]
    entry |= {name: ev.get(name) for name in ("score", "kl_to_ref", "length", "eos_rate")}
    return entry | {"heldout_pairs": held.get("pairs")}


def run_round(loop: Loop, k: int) -> dict:
    """Round k's unfinished stages in order, each recorded in the state file when done;
    returns the round's summary entry."""

    cfg, runtime, state = loop.cfg, loop.runtime, loop.state
    start, info = time.time(), {}
    if state.stages(k) and not state.done(k, "eval"):
        runtime.print(f"== iterate: resuming round {k} after {', '.join(state.stages(k))}")
    with fault_armed(k):
        for stage in (s for s in STAGES if not state.done(k, s)):
            runtime.print(f"== iterate round {k}/{cfg.iterate.rounds}: {stage}")
            entry: dict | None = None
            if stage == "samples":
                info = samples_stage(loop, k)
                entry = {"samples": info}
            elif stage == "rm":
                train_reward_model(stage_config(cfg, loop.layout, k, "rm"), runtime)
            elif stage == "ppo":
                train_ppo(stage_config(cfg, loop.layout, k, "ppo"), runtime)
            else:
                entry = eval_stage(loop, k) | _sample_info(loop, k, info)
                entry["wall_seconds"] = round(time.time() - start, 1)
            state.finish(k, stage, entry, write=runtime.is_main)
            runtime.barrier()
    entry = state.entry(k)
    assert entry is not None  # recorded by the round's first stage, samples
    return entry


def _sample_info(loop: Loop, k: int, info: dict) -> dict:
    """The samples stage's counts (this process's, or the state file's after a resume)."""
    info = info or (loop.state.entry(k) or {}).get("samples", {})
    names = (
        "new_pairs",
        "rm_train_pairs",
        "dropped_unfinished",
        "dropped_identical",
        "skipped_pairs",
    )
    return {name: info.get(name) for name in names}


def run_iterate(cfg: Config, runtime: Runtime) -> dict:
    """`rlhf-dist iterate`: iterate.rounds rounds (docs/iterate.md); writes and returns
    <output_dir>/summary.json {"rounds": [...], "wall_seconds"}."""
    root = Path(cfg.run.output_dir)
    state = IterateState.load(root, cfg.run.resume)
    labeller = build_labeller(cfg)
    if runtime.is_main:
        save_config(cfg, root)
    runtime.barrier()
    loop, start = Loop(cfg, runtime, Layout(root), state, labeller), time.time()
    rounds = []
    for k in range(1, cfg.iterate.rounds + 1):
        rounds.append(run_round(loop, k))
        summary = {"rounds": rounds, "wall_seconds": round(time.time() - start, 1)}
        if runtime.is_main:
            atomic_write_text(root / "summary.json", json.dumps(summary, indent=2) + "\n")
        runtime.print(format_round(rounds[-1]))
    runtime.barrier()
    return summary


def format_round(e: dict) -> str:
    """One console line of a round's figures."""
    parts = [f"== iterate round {e['round']}:"]
    if e.get("gold_reward") is not None:
        parts.append(f"gold {e['gold_reward']:.3f},")
    parts.append(f"RM accuracy on this policy {e['rm_accuracy_on_this_policy']:.3f},")
    if "rm_accuracy_on_previous_policy" in e:
        parts.append(f"on the previous policy {e['rm_accuracy_on_previous_policy']:.3f},")
    parts.append(f"KL to the reference {e['kl_to_ref']:.2f}")
    return " ".join(parts)
