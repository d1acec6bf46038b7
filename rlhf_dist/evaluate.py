"""Evaluate a policy: mean score on held-out prompts, gold reward if known, KL to a reference.

Responses come from the rollout's own path (rollout.collect_rollout). With reward.judge
and eval.reference, the judge also scores responses the reference samples for the same
prompts: judge_win_rate (docs/rewards.md). KL to the reference
is the mean over sampled responses of the k1 estimate (algo.kl.kl_estimate) summed over the
response's real tokens, at the sampling temperature: an unbiased estimate of the
sequence-level KL(pi || ref).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
from torch import nn

from rlhf_dist.algo.kl import kl_estimate
from rlhf_dist.algo.masking import masked_sum
from rlhf_dist.config import Config, PerfConfig
from rlhf_dist.data import inputs
from rlhf_dist.data.chat import prompt_text
from rlhf_dist.data.rows import PromptSet, Text, load_data, prompt_set
from rlhf_dist.distributed import Runtime, lockstep_map
from rlhf_dist.engine.decode import decode_responses, generate, truncate_after_eos
from rlhf_dist.engine.forward import DEFAULT_PERF
from rlhf_dist.errors import RewardFunctionError
from rlhf_dist.models import (
    ActorCritic,
    load_causal_lm,
    policy_stop_ids,
    tokenizer_for,
    train_dtype,
)
from rlhf_dist.models.vision import policy_vision
from rlhf_dist.observability import diagnostics as diag
from rlhf_dist.observability.tracking import open_run, write_summary
from rlhf_dist.rewards.scoring import (
    RewardFunction,
    RewardInputs,
    Scorer,
    WeightedReward,
    build_judge_reward,
    build_scorer,
    probe_rephrasings,
    retry_settings,
    reward_inputs_for,
)
from rlhf_dist.rollout import PromptBatch, RolloutModels, collect_rollout
from rlhf_dist.rollout.agent import Agent, build_agent
from rlhf_dist.rollout.endpoint import EndpointAgent
from rlhf_dist.stats import StatSums

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rlhf_dist.models import ValueModel

# gold(prompts, responses, finished) -> one oracle reward per response (eval.gold_function)
GoldFunction: TypeAlias = Callable[[list[Text], list[str], list[bool]], list[float]]
# (the response split for the rephrasing probe, its score, its length in tokens)
ProbeItem: TypeAlias = tuple[diag.Response, float, float]
# per-sequence measurements of a chunk: name -> (B,) tensor
Measured: TypeAlias = dict[str, torch.Tensor]


def load_gold_function(spec: str) -> GoldFunction:
    """`module:callable(prompts, responses, finished) -> list[float]` (an oracle reward),
    or a callable given through the Python API."""
    return inputs.resolve_callable(spec, "eval.gold_function")


def eval_models(
    policy: nn.Module,
    reference: nn.Module | None,
    scorer: Scorer,
    stops: tuple[int, ...],
    agent: Agent | EndpointAgent | None = None,
    perf: PerfConfig = DEFAULT_PERF,
) -> RolloutModels:
    """What the rollout reads, for evaluation: the policy without a critic (its log-probs
    give the KL), the reference (None: no KL), the scorer, the stop ids and the agent of
    multi-turn episodes (generation.tools / environment; None: single turns). Models are
    replicated in evaluation (run_eval), so generation needs no keep_in_step and the
    turns no lock-step. perf: the speed paths of generation and scoring."""

    @contextlib.contextmanager
    def generation_context() -> Iterator[tuple[nn.Module, None]]:
        yield policy, None

    actor = ActorCritic(policy, None, perf)
    return RolloutModels(
        actor, generation_context, reference, scorer, stops, agent=agent, perf=perf
    )


@torch.no_grad()
def evaluate_chunk(
    models: RolloutModels,
    gold_fn: GoldFunction | None,
    prompts: PromptBatch,
    cfg: Config,
    tokenizer: PreTrainedTokenizerBase,
    win_scorer: Scorer | None = None,
) -> tuple[Measured, list[str], list[ProbeItem]]:
    """Generate for one chunk of prompts and measure it, through the rollout's own
    generate -> truncate -> decode -> score -> missing-EOS penalty path
    (rollout.collect_rollout); returns per-sequence tensors, the response texts and the
    rephrasing-probe items. The tensors are (B,) each: score, length, eos_rate and, where
    measured, turns, tool_calls, kl_to_ref, gold_reward, judge_win_rate."""
    batch, responses = collect_rollout(
        models, prompts, cfg, tokenizer, micro_batch_size=prompts.ids.shape[0]
    )
    texts = prompts.texts
    mask, finished = batch.response_mask, batch.finished
    out = {"score": batch.scores, "length": mask.sum(1).float(), "eos_rate": finished.float()}
    if batch.turns is not None:  # multi-turn episodes (docs/agents.md)
        out |= {"turns": batch.turns.float(), "tool_calls": batch.tool_calls.float()}
    if models.reference is not None:
        # k1 summed over the response's real tokens (algo/masking.py's rule): an unbiased
        # estimate of the sequence-level KL(pi || ref) at the sampling temperature.
        kl = kl_estimate(batch.old_logprobs, batch.ref_logprobs, "k1")
        out["kl_to_ref"] = masked_sum(kl, mask, dim=1)
    if gold_fn is not None:
        out["gold_reward"] = torch.tensor(
            gold_fn(texts, responses, finished.tolist()), dtype=torch.float32
        )
    if win_scorer is not None:
        out["judge_win_rate"] = judge_wins(models, win_scorer, prompts, responses, cfg, tokenizer)
    scorer = _scorer(models)
    probe: list[ProbeItem] = []
    if scorer.reward_model is not None and scorer.inputs is None:
        probe = probe_items(
            batch.prompt_ids, batch.prompt_mask, batch.response_ids, mask, finished, out
        )
    elif scorer.reward_model is not None and scorer.inputs is not None:
        probe = own_token_probe_items(scorer.inputs, texts, responses, finished, out)
    return out, responses, probe


def _scorer(models: RolloutModels) -> Scorer:
    """The rewards.scoring.Scorer an evaluation's models score with (eval_models)."""
    assert isinstance(models.scorer, Scorer)
    return models.scorer


def judge_wins(
    models: RolloutModels,
    win_scorer: Scorer,
    prompts: PromptBatch,
    responses: list[str],
    cfg: Config,
    tokenizer: PreTrainedTokenizerBase,
) -> torch.Tensor:
    """(B,) 1 where the judge scores the policy's response above the reference's to the
    same prompt, 0.5 on a tie, 0 below: the reference samples its own responses with the
    same generation settings (docs/rewards.md, eval win rate). NaN once the judge failed
    (Scorer.score_texts; raised on every rank after the loop)."""
    stops = models.stop_ids or (tokenizer.eos_token_id,)
    reference = models.reference
    assert reference is not None  # a win rate is asked for only with eval.reference
    ref_ids = generate(
        reference, prompts.ids, prompts.mask, cfg.generation, tokenizer, None, stops, cfg.perf
    )
    ref_ids, ref_mask, _ = truncate_after_eos(ref_ids, stops, tokenizer.pad_token_id)
    ref_texts = decode_responses(tokenizer, ref_ids, ref_mask, stops)
    texts, columns = prompts.rows(slice(None))
    policy = win_scorer.score_texts(texts, responses, columns)
    return win_share(policy, win_scorer.score_texts(texts, ref_texts, columns))


def win_share(policy_scores: torch.Tensor, reference_scores: torch.Tensor) -> torch.Tensor:
    """(B,) 1 where policy_scores (B,) > reference_scores (B,), 0.5 where equal, else 0."""
    wins = (policy_scores > reference_scores).float()
    return wins + 0.5 * (policy_scores == reference_scores).float()


def probe_items(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    finished: torch.Tensor,
    out: Measured,
) -> list[ProbeItem]:
    """(diagnostics.Response, score, length) of each FINISHED response of a chunk, split
    before the stop token it ended with; prompts (B, P), responses (B, T), finished (B,)
    and the chunk's (B,) measurements `out` (score, length).

    Only those: the reward model was trained to read its score at an EOS, and an unfinished
    response's score is replaced by reward.missing_eos_penalty when that is set.
    """
    items = []
    for i in finished.nonzero().flatten().tolist():
        real = response_ids[i][response_mask[i]].tolist()
        prompt = prompt_ids[i][prompt_mask[i].bool()].tolist()
        response = diag.Response(prompt, real[:-1], real[-1:])
        items.append((response, float(out["score"][i]), float(out["length"][i])))
    return items


def own_token_probe_items(
    inputs: RewardInputs,
    texts: list[Text],
    responses: list[str],
    finished: torch.Tensor,
    out: Measured,
) -> list[ProbeItem]:
    """probe_items for a reward model with its own tokenizer (scoring.RewardInputs): each
    finished response in the reward model's tokens, by the same text round-trip that
    scored it. A response without a clean split (RewardInputs.probe_response) is left out."""
    items = []
    for i in finished.nonzero().flatten().tolist():
        response = inputs.probe_response(texts[i], responses[i])
        if response is not None:
            items.append((response, float(out["score"][i]), float(out["length"][i])))
    return items


def length_bias(
    runtime: Runtime,
    reward_model: ValueModel,
    items: list[ProbeItem],
    batch_size: int,
    tokenizer: PreTrainedTokenizerBase,
) -> dict[str, float]:
    """Length correlation and rephrasing probe of the reward model on sampled responses.

    items: this rank's probe_items. Returns {"length_corr", "rephrase_*"} over all ranks
    (docs/rm_diagnostics.md). Every rank must call this.
    """
    pairs = runtime.gather_objects([(score, length) for _, score, length in items])
    out = {"length_corr": diag.length_correlation(*zip(*pairs)) if pairs else 0.0}
    _, filler = diag.encode_filler(tokenizer)
    if filler:  # the same tokenizer on every rank: all ranks probe or none does
        responses, scores = [r for r, _, _ in items], [s for _, s, _ in items]
        pad = tokenizer.pad_token_id
        probe = probe_rephrasings(runtime, reward_model, responses, scores, filler, batch_size, pad)
        out |= {f"rephrase_{k}": v for k, v in probe.items() if v is not None}
    return out


def evaluate_policy(
    runtime: Runtime,
    models: RolloutModels,
    prompts: PromptSet,
    cfg: Config,
    tokenizer: PreTrainedTokenizerBase,
    gold_fn: GoldFunction | None = None,
    win_scorer: Scorer | None = None,
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Mean figures over `prompts` and some samples. Each rank takes every world_size-th
    prompt, in chunks of eval.batch_size run in lock-step (distributed/lockstep.py; a
    throw-away chunk is one prompt, scored and dropped). win_scorer: the judge (a Scorer
    of JudgeReward) for judge_win_rate against models.reference, or None."""
    stats = StatSums()
    samples: list[dict[str, Any]] = []
    probe: list[ProbeItem] = []
    n = min(cfg.eval.num_prompts, len(prompts.ids))

    def forward(chunk: list[int]) -> tuple[list[Text], Measured, list[str], list[ProbeItem]]:
        batch = PromptBatch.of(prompts, chunk, tokenizer.pad_token_id, runtime.device)
        return batch.texts, *evaluate_chunk(models, gold_fn, batch, cfg, tokenizer, win_scorer)

    mine = list(range(runtime.rank, n, runtime.world_size))
    functions = _scorer(models).reward_fn is not None  # the same on every rank
    for texts, out, responses, chunk_probe in lockstep_map(
        runtime, mine, cfg.eval.batch_size, forward, [0]
    ):
        add_measured(stats, out, functions)
        probe += chunk_probe
        samples += [
            {"prompt": prompt_text(t), "response": r, "score": _score(s)}
            for t, r, s in zip(texts, responses, out["score"].tolist())
        ]
    # the columns rewards logged with TRL's log_extra, of every chunk's rows (dropped
    # throw-away chunks' with them)
    extra = _scorer(models).take_extra_columns(
        [s["prompt"] for s in samples], [s["response"] for s in samples]
    )
    samples = [s | e for s, e in zip(samples, extra)]
    _scorer(models).raise_failure(runtime)
    if win_scorer is not None:
        win_scorer.raise_failure(runtime)
    summary = stats.reduce(runtime)
    # A reward function has no length bias to find. A reward model with its own tokenizer
    # is probed in its tokens (own_token_probe_items), with its tokenizer's filler and PAD.
    scorer = _scorer(models)
    if scorer.reward_model is not None:
        rm_tok = tokenizer if scorer.inputs is None else scorer.inputs.tokenizer
        summary |= length_bias(runtime, scorer.reward_model, probe, cfg.eval.batch_size, rm_tok)
    return summary, samples


def add_measured(stats: StatSums, out: Measured, functions: bool) -> None:
    """One chunk's (B,) measurements into `stats`. With reward functions (`functions`) a
    row no function applied to (every one returned None: a NaN score) is left out of the
    score's mean and counted as skipped_rows (summed over ranks), never a NaN mean."""
    for name, values in out.items():
        if name == "score" and functions:
            unscored = torch.isnan(values)
            stats.add("skipped_rows", unscored.sum(), 0.0)  # count 0: the sum over ranks
            values = values[~unscored]
        stats.add(name, values.sum(), values.numel())


def _score(value: float) -> float | None:
    """A sample's score, None (JSON null) where no reward applied to it."""
    return None if math.isnan(value) else value


def win_rate_judge(runtime: Runtime, cfg: Config, scorer: Scorer) -> Scorer | None:
    """The judge that compares policy and eval.reference (reward.judge; None: no judge):
    the one the scorer already holds as a reward component, with the run's retries."""
    if cfg.reward.judge == "none":
        return None
    fn = scorer.reward_fn
    judge = fn.judge if isinstance(fn, WeightedReward) else None
    if judge is None:  # not built as a reward component (cannot happen with reward.judge set)
        judge = build_judge_reward(runtime, cfg.reward, cfg.model, cfg.perf)
    retry = retry_settings(cfg.reward) if cfg.reward.judge == "model" else {"retries": 0}
    return Scorer(reward_fn=RewardFunction(judge, key="reward.judge", **retry))


def run_eval(cfg: Config, runtime: Runtime) -> dict[str, float]:
    """`rlhf-dist eval`: writes summary.json and samples.jsonl under run.output_dir."""
    m = cfg.model
    tokenizer = tokenizer_for(cfg, "policy")
    which = "eval" if cfg.data.eval else "train"
    where = f"data.{which} {getattr(cfg.data, which)!r}"
    vision = policy_vision(cfg, samples=True)  # a vision-language policy's image prompts
    prompts = prompt_set(load_data(cfg.data, which), tokenizer, cfg.data, where, vision)
    agent = build_agent(cfg, tokenizer)  # tools resolved and shown, before any model loads
    # Evaluation replicates its models on every rank: sampling from partitioned (ZeRO-3)
    # weights would need every rank to step each token together. Its chunks still run in
    # lock-step (evaluate_policy), as every forward-only loop does.
    # Whole on every rank even where ZeRO-3 engines exist in this process (local_loading).
    with runtime.local_loading():
        policy = load_causal_lm(m.policy, "model.policy", train_dtype(m), m)
    policy = runtime.prepare_frozen(policy, "replicate")
    reference = None
    if cfg.eval.reference:
        with runtime.local_loading():
            reference = load_causal_lm(cfg.eval.reference, "eval.reference", train_dtype(m), m)
        reference = runtime.prepare_frozen(reference, "replicate")
    gold_fn = load_gold_function(cfg.eval.gold_function) if cfg.eval.gold_function else None
    out, logger = open_run(cfg, runtime, "eval", None)
    runtime.seed_per_rank(cfg.run.seed)
    rm_inputs, stops = reward_inputs_for(cfg), policy_stop_ids(cfg, tokenizer)
    scorer = build_scorer(
        runtime, cfg.reward.function, m, "replicate", rm_inputs, cfg.reward, cfg.perf, stops
    )
    models = eval_models(policy, reference, scorer, stops, agent, cfg.perf)
    win_scorer = win_rate_judge(runtime, cfg, scorer) if reference is not None else None
    try:
        summary, samples = evaluate_policy(
            runtime, models, prompts, cfg, tokenizer, gold_fn, win_scorer
        )
    except RewardFunctionError:
        logger.discard()  # nothing measured: leave no run directory (a user mistake)
        raise
    samples = runtime.gather_objects(samples)
    shown = (
        "score",
        "gold_reward",
        "kl_to_ref",
        "judge_win_rate",
        "length",
        "eos_rate",
        "length_corr",
    )
    logger.log(0, {f"eval/{k}": v for k, v in summary.items()}, tuple(f"eval/{k}" for k in shown))
    if runtime.is_main:
        with (out / "samples.jsonl").open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(s) + "\n" for s in samples)
    write_summary(runtime, out, summary)
    logger.close()
    return summary
