"""Evaluate a policy: mean score on held-out prompts, gold reward if known, KL to a reference.

KL to the reference is the mean over sampled responses of sum_t (log pi - log ref) at the
sampling temperature: an unbiased estimate of the sequence-level KL(pi || ref).
"""

from __future__ import annotations

import importlib
import json

import torch

from rlhf_dist import diagnostics as diag
from rlhf_dist.chat import prompt_text
from rlhf_dist.config import ConfigError
from rlhf_dist.data import left_pad, load_rows, prompt_set
from rlhf_dist.models import load_causal_lm, policy_stop_ids, token_logprobs, tokenizer_for
from rlhf_dist.rollout import (
    decode_responses,
    generate,
    scores_with_eos_penalty,
    sequence_last_index,
    truncate_after_eos,
)
from rlhf_dist.scoring import build_scorer, probe_rephrasings, reward_inputs_for
from rlhf_dist.stats import StatSums
from rlhf_dist.tracking import open_run, write_summary


def load_gold_function(spec: str):
    """`module:callable(prompts, responses, finished) -> list[float]` (an oracle reward)."""
    module_name, _, attr = spec.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"eval.gold_function: cannot import {spec!r} ({e})") from None


@torch.no_grad()
def evaluate_chunk(
    policy, reference, scorer, gold_fn, prompt_ids, prompt_mask, texts, cfg, tokenizer, stops=None
):
    """Generate for one chunk of prompts and measure it; returns per-sequence tensors.
    stops: the ids that end a response (models.policy_stop_ids; None: the tokenizer's EOS)."""
    eos, pad = stops or (tokenizer.eos_token_id,), tokenizer.pad_token_id
    gen = cfg.generation
    response_ids = generate(policy, prompt_ids, prompt_mask, gen, tokenizer, stop_ids=eos)
    response_ids, response_mask, finished = truncate_after_eos(response_ids, eos, pad)
    responses = decode_responses(tokenizer, response_ids, response_mask, eos)
    input_ids = torch.cat([prompt_ids, response_ids], 1)
    attention_mask = torch.cat([prompt_mask, response_mask.long()], 1)
    last = sequence_last_index(prompt_ids.shape[1], response_mask)
    raw = scorer(texts, responses, input_ids, attention_mask, last)
    out = {
        "score": scores_with_eos_penalty(raw, finished, cfg.reward.missing_eos_penalty),
        "length": response_mask.sum(1).float(),
        "eos_rate": finished.float(),
    }
    if reference is not None:
        temperature = cfg.generation.temperature
        lp, _ = token_logprobs(policy, input_ids, attention_mask, response_mask, temperature)
        ref, _ = token_logprobs(reference, input_ids, attention_mask, response_mask, temperature)
        out["kl_to_ref"] = ((lp - ref) * response_mask).sum(1)
    if gold_fn is not None:
        out["gold_reward"] = torch.tensor(
            gold_fn(texts, responses, finished.tolist()), dtype=torch.float32
        )
    probe = []
    if scorer.reward_model is not None and scorer.inputs is None:
        probe = probe_items(prompt_ids, prompt_mask, response_ids, response_mask, finished, out)
    elif scorer.reward_model is not None:
        probe = own_token_probe_items(scorer.inputs, texts, responses, finished, out)
    return out, responses, probe


def probe_items(prompt_ids, prompt_mask, response_ids, response_mask, finished, out):
    """(diagnostics.Response, score, length) of each FINISHED response of a chunk, split
    before the stop token it ended with.

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


def own_token_probe_items(inputs, texts, responses, finished, out):
    """probe_items for a reward model with its own tokenizer (scoring.RewardInputs): each
    finished response in the reward model's tokens, by the same text round-trip that
    scored it. A response without a clean split (RewardInputs.probe_response) is left out."""
    items = []
    for i in finished.nonzero().flatten().tolist():
        response = inputs.probe_response(texts[i], responses[i])
        if response is not None:
            items.append((response, float(out["score"][i]), float(out["length"][i])))
    return items


def length_bias(runtime, reward_model, items, batch_size: int, tokenizer) -> dict:
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
    runtime, policy, reference, scorer, prompts, cfg, tokenizer, gold_fn=None, stops=None
):
    """Mean figures over `prompts` (each rank takes every world_size-th) and some samples;
    stops: the ids that end a response (None: the tokenizer's EOS)."""
    stats, samples, probe = StatSums(), [], []
    n = min(cfg.eval.num_prompts, len(prompts.ids))
    mine = list(range(runtime.rank, n, runtime.world_size))
    for start in range(0, len(mine), cfg.eval.batch_size):
        chunk = mine[start : start + cfg.eval.batch_size]
        ids, mask = left_pad([prompts.ids[i] for i in chunk], tokenizer.pad_token_id)
        texts = [prompts.texts[i] for i in chunk]
        out, responses, chunk_probe = evaluate_chunk(
            policy,
            reference,
            scorer,
            gold_fn,
            ids.to(runtime.device),
            mask.to(runtime.device),
            texts,
            cfg,
            tokenizer,
            stops,
        )
        for name, values in out.items():
            stats.add(name, values.sum(), values.numel())
        probe += chunk_probe
        samples += [
            {"prompt": prompt_text(t), "response": r, "score": float(s)}
            for t, r, s in zip(texts, responses, out["score"])
        ]
    summary = stats.reduce(runtime)
    # A reward function has no length bias to find. A reward model with its own tokenizer
    # is probed in its tokens (own_token_probe_items), with its tokenizer's filler and PAD.
    if scorer.reward_model is not None:
        rm_tok = tokenizer if scorer.inputs is None else scorer.inputs.tokenizer
        summary |= length_bias(runtime, scorer.reward_model, probe, cfg.eval.batch_size, rm_tok)
    return summary, samples


def run_eval(cfg, runtime) -> dict:
    """`rlhf-dist eval`: writes summary.json and samples.jsonl under run.output_dir."""
    m = cfg.model
    tokenizer = tokenizer_for(cfg, "policy")
    source = cfg.data.eval or cfg.data.train
    key = "data.eval" if cfg.data.eval else "data.train"
    prompts = prompt_set(load_rows(source, key), tokenizer, cfg.data, f"{key} {source!r}")
    # Evaluation replicates its models on every rank: ranks may get different numbers of
    # prompt chunks, which partitioned (ZeRO-3) models could not serve without lock-step.
    policy = load_causal_lm(m.policy, "model.policy", m.dtype, m)
    policy = runtime.prepare_frozen(policy, "replicate")
    reference = None
    if cfg.eval.reference:
        reference = load_causal_lm(cfg.eval.reference, "eval.reference", m.dtype, m)
        reference = runtime.prepare_frozen(reference, "replicate")
    gold_fn = load_gold_function(cfg.eval.gold_function) if cfg.eval.gold_function else None
    out, logger = open_run(cfg, runtime, "eval", None)
    runtime.seed_per_rank(cfg.run.seed)
    summary, samples = evaluate_policy(
        runtime,
        policy,
        reference,
        build_scorer(runtime, cfg.reward.function, m, "replicate", reward_inputs_for(cfg)),
        prompts,
        cfg,
        tokenizer,
        gold_fn,
        policy_stop_ids(cfg, tokenizer),
    )
    samples = runtime.gather_objects(samples)
    shown = ("score", "gold_reward", "kl_to_ref", "length", "eos_rate", "length_corr")
    logger.log(0, {f"eval/{k}": v for k, v in summary.items()}, tuple(f"eval/{k}" for k in shown))
    if runtime.is_main:
        with (out / "samples.jsonl").open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(s) + "\n" for s in samples)
    write_summary(runtime, out, summary)
    logger.close()
    return summary
