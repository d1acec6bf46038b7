"""Rollout: generate responses, then score them with every model PPO needs.

generate (actor, sampling, left-padded prompts) -> truncate after the first EOS ->
old_logprobs + old_values (actor-critic forward, training dtype; no values without a
critic) -> ref_logprobs ->
scores (reward model at the last real token, or a Python reward function).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from rlhf_dist import agent as agent_mod
from rlhf_dist.algo.logprobs import scale_logits
from rlhf_dist.algo.masking import last_token_index
from rlhf_dist.chat import is_stop
from rlhf_dist.distributed.zero3 import stays_whole
from rlhf_dist.models import (
    cache_of,
    causal_lm,
    distinct_prompt_cache,
    grouped_query_attention_on_cpu,
    position_ids_from,
    shares_prompts,
    token_logprobs,
)
from rlhf_dist.scoring import Scorer


@dataclass
class RolloutBatch:
    """One rank's rollout. Shapes: B sequences, P prompt tokens, T response tokens."""

    prompt_ids: torch.Tensor  # (B, P) left-padded
    prompt_mask: torch.Tensor  # (B, P) 1 on real prompt tokens
    response_ids: torch.Tensor  # (B, T) PAD after the first EOS
    response_mask: torch.Tensor  # (B, T) bool, True up to and including the first EOS
    # (B, T), 0 outside response_mask; None until the update's first forward gives them
    # (the skip of trainers/ppo.py::old_logprobs_from_update)
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor  # (B, T), 0 outside response_mask
    old_values: torch.Tensor | None  # (B, T); None without a critic
    scores: torch.Tensor  # (B,) after the missing-EOS penalty
    raw_scores: torch.Tensor  # (B,) as the reward model / function gave them
    finished: torch.Tensor  # (B,) bool, the response ended with EOS
    entropy: torch.Tensor | None  # (B, T) of the sampling distribution; None like old_logprobs
    # (B, T) log-probs the sampled tokens had in the engine that sampled them, when that
    # is not the trainer (generation.backend=vllm); None with the hf backend.
    sampler_logprobs: torch.Tensor | None = None
    # Multi-turn rollouts (rlhf_dist/agent.py); None for single-turn ones. (B, T) long, 1
    # on every token of the episode: sampled turns AND tool/environment messages, which
    # are attended to but are not in response_mask (never trained on, no KL, no entropy).
    response_attention: torch.Tensor | None = None
    turns: torch.Tensor | None = None  # (B,) long, assistant turns per episode
    tool_calls: torch.Tensor | None = None  # (B,) long, tool messages per episode
    tool_errors: torch.Tensor | None = None  # (B,) long, tool calls that failed

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.response_attention_mask], dim=1)

    @property
    def response_attention_mask(self) -> torch.Tensor:
        """(B, T) long: the response positions attended to (response_mask single-turn)."""
        if self.response_attention is not None:
            return self.response_attention
        return self.response_mask.long()

    def select(self, index) -> RolloutBatch:
        return RolloutBatch(**{f.name: _index(getattr(self, f.name), index) for f in fields(self)})

    def trimmed(self) -> tuple[RolloutBatch, int]:
        """This batch without the columns that are padding in every row, and the number T'
        of response columns kept (a prefix: cut per-token tensors to [:, :T'] alike).

        Dropped: leading prompt columns (left padding of the longest prompt in a larger
        batch) and response columns after every row's last real token. Outputs at the kept
        positions do not change (positions come from the attention mask and causal
        attention never looks right), so losses and gradients are the same while the
        padding costs nothing: a micro-batch drawn from a rollout of ragged lengths is
        often much narrower than the rollout.
        """
        P, T = self.prompt_ids.shape[1], self.response_ids.shape[1]
        cols = torch.arange(max(P, T), device=self.prompt_ids.device)
        first = torch.where(self.prompt_mask.bool().any(0), cols[:P], P).min()
        end = torch.where(self.response_attention_mask.bool().any(0), cols[:T] + 1, 1).max()
        start, keep = torch.stack([first, end]).tolist()  # one host sync for both
        if start == 0 and keep == T:
            return self, T
        cut = {}
        for f in fields(self):
            x = getattr(self, f.name)
            if x is None:
                pass
            elif f.name.startswith("prompt_"):
                x = x[:, start:]
            elif x.dim() == 2:  # (B, T) response-aligned
                x = x[:, :keep]
            cut[f.name] = x
        return RolloutBatch(**cut), keep


def _index(x: torch.Tensor | None, index):
    return None if x is None else x[index]


def truncate_after_eos(response_ids: torch.Tensor, stop_ids, pad_id: int):
    """(ids, response_mask, finished): mask True up to and including the first stop token
    (any of `stop_ids`, an id or a sequence; "EOS" below).

    response_ids: (B, T). Tokens after the first EOS become PAD (generate may already
    pad them); rows without EOS keep all T tokens and have finished=False.
    """
    is_eos = is_stop(response_ids, stop_ids)
    # Number of EOS strictly before t: 0 means t is at or before the first EOS.
    eos_before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()
    mask = eos_before == 0
    ids = torch.where(mask, response_ids, torch.full_like(response_ids, pad_id))
    return ids, mask, is_eos.any(dim=1)


@torch.no_grad()
def generate(model, prompt_ids, prompt_mask, gen_cfg, tokenizer, keep_in_step=None, stop_ids=None):
    """Sample responses for left-padded prompts (B, P): (B, T) ids, T <= max_new_tokens,
    PAD after a row's first stop token (any of `stop_ids`; None: the tokenizer's EOS);
    T is shorter only when every row has finished.

    A plain KV-cache decode loop: one prefill forward, then one forward per token. It
    does what transformers' `generate` did for us with ~20% less time outside the model
    on a small policy (no logits-processor, stopping-criteria and input-preparation
    layers per token). Positions count real tokens only, as in scoring, so a left-padded
    prompt is continued exactly as it would be on its own.
    keep_in_step (ZeRO-3 without gathered weights, where every forward gathers layers
    with collectives): called once per step with whether this rank needs another
    forward, it returns whether any rank does; a finished rank then runs throw-away
    forwards until all ranks are done, so none waits forever for the others.
    """
    pad, steps = tokenizer.pad_token_id, gen_cfg.max_new_tokens
    stops = (tokenizer.eos_token_id,) if stop_ids is None else stop_ids
    eos = torch.as_tensor(stops, dtype=torch.long, device=prompt_ids.device).reshape(-1)
    with packed_linears(model, prompt_ids.shape[0]), grouped_query_attention_on_cpu():
        return _decode(model, prompt_ids, prompt_mask, gen_cfg, keep_in_step, eos, pad, steps)


def _decode(model, prompt_ids, prompt_mask, gen_cfg, keep_in_step, eos, pad: int, steps: int):
    """`generate`'s loop: (B, T) sampled ids, PAD after a row's stop token."""
    mask = prompt_mask.long()
    logits, cache = _prefill(model, prompt_ids, mask)
    position = position_ids_from(mask)[:, -1:]
    finished = torch.zeros(prompt_ids.shape[0], dtype=torch.bool, device=prompt_ids.device)
    tokens, more = [], True  # more: this rank still samples (one host sync per token)
    while True:
        if more:
            allow_eos = len(tokens) >= gen_cfg.min_new_tokens
            token = sample_next(logits, gen_cfg, eos, allow_eos)
            tokens.append(torch.where(finished, pad, token))
            finished |= is_stop(tokens[-1], eos)
            more = len(tokens) < steps and not bool(finished.all())
        if not (more if keep_in_step is None else keep_in_step(more)):
            return torch.stack(tokens, dim=1)
        feed = tokens[-1] if more else torch.full_like(tokens[-1], pad)  # throw-away forward
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        position = position + 1
        out = model(
            input_ids=feed[:, None], attention_mask=mask, position_ids=position, use_cache=True,
            **cache,
        )  # fmt: skip
        logits, cache = out.logits[:, -1], cache_of(out)


def _prefill(model, prompt_ids, mask):
    """The prefill forward of left-padded prompts (B, P): the last position's logits
    (B, V) and the KV cache (`cache_of`). With model.shared_prompt_forward each distinct
    prompt runs once and its cache and logits are indexed out to its rows (algo/prefix.py):
    GRPO's n samples of a prompt cost one prompt forward, not n."""
    if _shares_prompts(model):
        out, cache, inverse = distinct_prompt_cache(model, prompt_ids, mask)
        return out.logits[:, -1].index_select(0, inverse), cache
    out = model(
        input_ids=prompt_ids, attention_mask=mask, position_ids=position_ids_from(mask),
        use_cache=True, logits_to_keep=1,
    )  # fmt: skip
    return out.logits[:, -1], cache_of(out)


# The packed copies live for one `generate` call; above this many bytes of linear weights
# (a ~0.5B-parameter fp32 model) that second copy of the weights costs more host memory
# than a CPU rollout should take, and the products are nearer the GEMM rate anyway.
PACK_LIMIT_BYTES = 2 * 2**30


@contextlib.contextmanager
def packed_linears(model, rows: int):
    """Inside: every plain fp32 `nn.Linear` of `model` whose weight is a whole CPU tensor
    computes its products from a copy of the weight that MKL packed once for `rows`-row
    inputs (cblas_sgemm_pack, torch.ops.mkl), instead of MKL packing the weight again in
    every call. A decode step feeds each linear the B rows of the micro-batch, so that
    repacking streamed every weight through memory twice per token: SmolLM2 at B = 16 on
    the 2-core AMX VM, the linears of 48 decode steps 2.7 s -> 1.9-2.1 s, a whole generate
    4.14 s (plain) / 4.40 s (W x^T products, what this replaced) -> 3.75 s with the
    packing, the same tokens (docs/benchmarks.md). MKL computes a packed product with the
    same kernels: the same bits as F.linear, for `rows` rows and for any other row count
    (which it runs unpacked). No autograd: `generate` only (no grad). Left as they are:
    other dtypes, fp32 weights under CPU autocast (mixed precision: the products run in
    bf16), ZeRO-3 partitioned weights (whole only while their module runs), a build
    without MKL, and models whose linear weights exceed PACK_LIMIT_BYTES; an input that is
    not fp32, or autocast entered inside, goes to F.linear. Modules are restored on exit;
    the packed copies are freed."""
    linears = _packable_linears(model)
    for m in linears:
        packed = torch.ops.mkl._mkl_reorder_linear_weight(m.weight.detach(), rows)
        m.forward = functools.partial(_packed_forward, m, packed, rows)
    try:
        yield
    finally:
        for m in linears:
            del m.forward


def _packable_linears(model) -> list[torch.nn.Linear]:
    """`packed_linears`' modules: plain fp32 CPU linears with whole weights, or none."""
    if not (torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")):
        return []
    if torch.is_autocast_enabled("cpu"):
        return []
    linears = [
        m for m in model.modules()
        if type(m) is torch.nn.Linear and m.weight.device.type == "cpu"
        and m.weight.dtype == torch.float32 and stays_whole(m.weight)
        and m.weight.dim() == 2 and m.weight.numel() > 0
    ]  # fmt: skip
    size = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    return linears if size <= PACK_LIMIT_BYTES else []


def _packed_forward(linear: torch.nn.Linear, packed, rows: int, x: torch.Tensor):
    """linear(x) for x (..., in) from the packed weight: (..., out), contiguous."""
    if x.dtype != torch.float32 or torch.is_autocast_enabled("cpu"):
        # MKL's packed product is fp32 x fp32 only; autocast's is the module's own
        return torch.nn.functional.linear(x, linear.weight, linear.bias)
    flat = x.reshape(-1, x.shape[-1])
    y = torch.ops.mkl._mkl_linear(flat, packed, linear.weight, linear.bias, rows)
    return y.reshape(*x.shape[:-1], linear.weight.shape[0])


def _shares_prompts(model) -> bool:
    """models.shares_prompts of the transformers model inside `model`; a model that is
    not a transformers one never shares."""
    try:
        return shares_prompts(causal_lm(model))
    except TypeError:
        return False


def sample_next(logits, gen_cfg, eos_id, allow_eos: bool) -> torch.Tensor:
    """One token per row, (B,), drawn from softmax(logits / temperature) after EOS
    suppression (min_new_tokens) and top-k / top-p truncation; logits (B, V). eos_id: one
    id or a (S,) tensor of stop ids, all suppressed alike."""
    logits = scale_logits(logits, gen_cfg.temperature)
    if not truncates(gen_cfg.top_k, gen_cfg.top_p, logits.shape[-1]):
        # No truncation: suppressing EOS is zeroing its probability (the sampler takes
        # unnormalised rows), in the softmax's own output: no copy of the logits.
        probs = torch.softmax(logits, dim=-1)
        if not allow_eos:
            probs[:, eos_id] = 0.0
        return sample_categorical(probs)
    if not allow_eos:  # truncation must see the distribution without EOS
        logits = logits.clone()  # scale_logits may return the model's own tensor
        logits[:, eos_id] = float("-inf")
    logits = truncate_logits(logits, gen_cfg.top_k, gen_cfg.top_p)
    return sample_categorical(torch.softmax(logits, dim=-1))


def sample_categorical(probs: torch.Tensor, block: int = 256) -> torch.Tensor:
    """One index per row of probs (B, V) -> (B,), drawn by inverting the CDF: one uniform
    per row, located first among the float64 cumulative masses of blocks of `block`
    entries, then inside its block. torch.multinomial draws one exponential per
    vocabulary entry instead (B x V random numbers a token: 13.6 of ~100 ms per decode
    step of SmolLM2 at batch 16 on the 2-core CPU), and one float64 cumsum over all V
    would write 2x the rows' bytes: the blocks read them once (~0.4 ms). Exact: an entry
    of probability 0 spans no interval of either CDF, so it is never drawn (each uniform
    stays below its CDF's total). Rows need not sum to 1; a row that is not finite or
    has no mass is an error, as with torch.multinomial."""
    B, V = probs.shape
    sums = _block_sums(probs, block)  # (B, K) float64
    cdf = sums.cumsum(dim=-1)
    total = cdf[:, -1:]  # (B, 1)
    if not bool((torch.isfinite(total) & (total > 0)).all()):
        raise ValueError("sampling probabilities are not finite or sum to 0 (NaN/inf logits?)")
    u = _below(torch.rand(total.shape, dtype=cdf.dtype, device=probs.device) * total, total)
    k = torch.searchsorted(cdf, u, right=True)  # (B, 1): a block with mass
    before = torch.where(k > 0, cdf.gather(1, (k - 1).clamp(min=0)), 0.0)
    idx = k * block + torch.arange(block, device=probs.device)  # (B, block)
    inside = probs.gather(1, idx.clamp(max=V - 1)).masked_fill(idx >= V, 0.0)
    inner = inside.cumsum(dim=-1, dtype=torch.float64)
    j = torch.searchsorted(inner, _below((u - before).clamp(min=0.0), inner[:, -1:]), right=True)
    return idx.gather(1, j).squeeze(1)


def _block_sums(probs: torch.Tensor, block: int) -> torch.Tensor:
    """(B, ceil(V / block)) sums of consecutive entries, the last block possibly short:
    summed in the rows' dtype (a float64 sum would first copy all of them to float64;
    a block's sum is then off by rounding only), returned in float64 for the cumsum over
    blocks, where the last blocks' masses must not vanish against the total."""
    B, V = probs.shape
    full = V - V % block
    sums = probs[:, :full].reshape(B, -1, block).sum(-1)
    if full < V:
        sums = torch.cat([sums, probs[:, full:].sum(-1, keepdim=True)], dim=1)
    return sums.double()


def _below(u: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """u capped at the largest float below `total`: searchsorted(cdf, u, right=True) then
    lands on an entry of mass, never past the last one."""
    return torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))


def truncates(top_k: int, top_p: float, vocab: int) -> bool:
    """Whether `truncate_logits` drops any token of a `vocab`-wide distribution."""
    return 0 < top_k < vocab or top_p < 1.0


def truncate_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Logits (B, V) with tokens outside the top-k and the nucleus set to -inf.

    top_k = 0 and top_p = 1.0 turn each off. The nucleus (Holtzman et al. 2020) is the
    smallest set of most likely tokens whose probability reaches top_p: a token stays
    while the tokens ranked above it hold less than top_p, so the most likely one always
    stays. Tokens tied with the k-th largest logit stay too.
    """
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ranked, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(ranked, dim=-1)
        mass_above = torch.cumsum(probs, dim=-1) - probs
        drop = torch.zeros_like(mass_above, dtype=torch.bool)
        drop.scatter_(-1, order, mass_above >= top_p)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def pad_columns(x: torch.Tensor, width: int, value) -> torch.Tensor:
    """Right-pad (B, T) to (B, width) with `value`."""
    if x.shape[1] >= width:
        return x
    pad = torch.full((x.shape[0], width - x.shape[1]), value, dtype=x.dtype, device=x.device)
    return torch.cat([x, pad], dim=1)


def decode_responses(tokenizer, response_ids, response_mask, stop_ids) -> list[str]:
    """Response texts without PAD and stop tokens (an id or a sequence of ids)."""
    keep = response_mask & ~is_stop(response_ids, stop_ids)
    return [
        tokenizer.decode(row[m].tolist(), skip_special_tokens=True)
        for row, m in zip(response_ids, keep)
    ]


def scores_with_eos_penalty(raw_scores, finished, penalty: float | None) -> torch.Tensor:
    """Replace the score of responses that never emitted EOS by `penalty` (N+ study)."""
    if penalty is None:
        return raw_scores
    return torch.where(finished, raw_scores, torch.full_like(raw_scores, penalty))


def sequence_last_index(prompt_width: int, response_mask: torch.Tensor) -> torch.Tensor:
    """Position in the full (P+T) sequence of each response's last real token; (B,)."""
    return prompt_width + last_token_index(response_mask)


@dataclass
class RolloutModels:
    """What a rollout reads: the (possibly wrapped) actor-critic for scoring, a context
    yielding (actor module, keep_in_step) for generation, the frozen reference, the scorer,
    the ids that end a response (models.policy_stop_ids; empty: the tokenizer's EOS),
    with generation.backend=vllm this rank's engine (vllm_rollout.VLLMEngine), a
    context in which the actor-critic's weights are whole (under ZeRO-3: gathered once,
    not layer by layer in every forward; a no-op elsewhere), and for multi-turn rollouts
    the agent (rlhf_dist/agent.py) and the per-turn lock-step collective."""

    actor_critic: torch.nn.Module
    generation_context: Callable
    reference: torch.nn.Module | None
    scorer: Scorer
    stop_ids: tuple[int, ...] = ()
    engine: object | None = None
    whole_weights: Callable = contextlib.nullcontext
    agent: agent_mod.Agent | None = None  # multi-turn rollouts (generation.tools / environment)
    any_rank: Callable | None = None  # Runtime.any_rank with several ranks: turns in lock-step


@torch.no_grad()
def collect_rollout(
    models: RolloutModels,
    prompt_ids,
    prompt_mask,
    prompt_texts,
    cfg,
    tokenizer,
    timings=None,
    micro_batch_size: int | None = None,
    old_logprobs: bool = True,
):
    """Generate and score one rank's prompts in rollout micro-batches -> RolloutBatch, and
    the response texts: generate -> truncate after EOS -> decode -> old/ref log-probs,
    values and scores -> missing-EOS penalty. PPO's rollout and `rlhf-dist eval` alike.

    micro_batch_size: prompts per generation/scoring pass (None: ppo.rollout_micro_batch_size).
    old_logprobs=False: no actor pass in scoring (old_logprobs and entropy stay None; the
    update's first forward gives them, trainers/ppo.py::old_logprobs_from_update)."""
    gen = cfg.generation
    micro = micro_batch_size or cfg.ppo.rollout_micro_batch_size
    chunks = [slice(i, i + micro) for i in range(0, prompt_ids.shape[0], micro)]
    # hf: sampling and scoring in one span of whole weights (one gather under ZeRO-3).
    # vLLM samples from its own copy: whole weights only for its sync, then for scoring.
    hf = models.engine is None
    with models.whole_weights() if hf else contextlib.nullcontext():
        start = time.perf_counter()
        play = _single_turn if models.agent is None else _episodes  # episodes: agent.py
        sampled, score_prompts, texts, env_scores = play(
            models, prompt_ids, prompt_mask, prompt_texts, gen, chunks, tokenizer
        )
        generated = time.perf_counter()
        # nested under hf: already whole. No gradients: the grouped KV heads go to CPU
        # attention uncopied, the same values (generate has its own context).
        with models.whole_weights(), grouped_query_attention_on_cpu():
            parts = [
                _score_chunk(
                    models, sampled, s, score_prompts[s], texts[s], gen.temperature, old_logprobs
                )
                for s in chunks
            ]
    merged = {
        k: None if parts[0][k] is None else torch.cat([p[k] for p in parts]) for k in parts[0]
    }
    if env_scores is not None:  # the environment's reward where it gave one
        given = ~torch.isnan(env_scores)
        merged["raw_scores"] = torch.where(given, env_scores, merged["raw_scores"])
    finished = sampled["finished"]
    scores = scores_with_eos_penalty(merged["raw_scores"], finished, cfg.reward.missing_eos_penalty)
    if timings is not None:  # seconds spent generating, and scoring with the four models
        timings |= {"generate": generated - start, "score": time.perf_counter() - generated}
    return RolloutBatch(scores=scores, **sampled, **merged), texts


def _single_turn(models: RolloutModels, prompt_ids, prompt_mask, prompt_texts, gen, chunks,
                 tokenizer):  # fmt: skip
    """One response per prompt -> (the rollout tensors, the prompts and response texts the
    scorer reads, None: no environment rewards)."""
    eos, pad = models.stop_ids or (tokenizer.eos_token_id,), tokenizer.pad_token_id
    response_ids, sampler_logprobs = _sample(
        models, prompt_ids, prompt_mask, gen, chunks, tokenizer
    )
    response_ids, response_mask, finished = truncate_after_eos(response_ids, eos, pad)
    texts = decode_responses(tokenizer, response_ids, response_mask, eos)
    sampled = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "response_ids": response_ids,
        "response_mask": response_mask,
        "finished": finished,
        "sampler_logprobs": sampler_logprobs,
    }
    return sampled, prompt_texts, texts, None


def _episodes(models: RolloutModels, prompt_ids, prompt_mask, prompt_texts, gen, chunks,
              tokenizer):  # fmt: skip
    """Multi-turn episodes of every prompt, in rollout micro-batches -> (the rollout
    tensors of agent.episode_batch, what reward.function reads: the conversations before
    the final answers and the answers, the environment's rewards (B,), NaN where none).
    The data's prompt ids are not sampled from (an episode starts from the environment's
    first messages, rendered with the tools); vLLM's sync check reads them."""
    eos, pad = models.stop_ids or (tokenizer.eos_token_id,), tokenizer.pad_token_id
    play = functools.partial(agent_mod.run_episodes, models.agent, gen=gen, tokenizer=tokenizer,
                             stop_ids=eos, any_rank=models.any_rank)  # fmt: skip
    episodes, engine = [], models.engine
    with models.generation_context() as (actor, keep_in_step):
        if engine is None:
            for s in chunks:
                episodes += play(actor, keep_in_step, prompt_texts[s])
        else:  # vLLM schedules its own batches: the whole shard, every turn in one call
            engine.load_weights(actor)
            if engine.checks_sync:
                engine.check_sync(actor, prompt_ids, prompt_mask, gen, tokenizer, eos)
    if engine is not None:
        sampler = functools.partial(_engine_sample, engine, pad)
        episodes = play(None, None, list(prompt_texts), sampler=sampler)
        engine.sleep()  # GPU: free its memory for scoring and the update
    device = next(iter(models.actor_critic.parameters())).device
    sampled = agent_mod.episode_batch(episodes, tokenizer.pad_token_id, device)
    env_scores = sampled.pop("env_scores")
    score_prompts, texts = agent_mod.scoring_inputs(episodes)
    return sampled, score_prompts, texts, env_scores


def _sample(models: RolloutModels, prompt_ids, prompt_mask, gen, chunks, tokenizer):
    """Responses (B, T), PAD-padded, and the sampler's log-probs (B, T) (None: the hf
    backend, whose sampler is the trainer's own forward)."""
    eos, pad = models.stop_ids or (tokenizer.eos_token_id,), tokenizer.pad_token_id
    if models.engine is not None:
        with models.generation_context() as (actor, _):  # whole weights, once per rollout
            models.engine.load_weights(actor)
            if models.engine.checks_sync:
                models.engine.check_sync(actor, prompt_ids, prompt_mask, gen, tokenizer, eos)
        # vLLM schedules its own batches: the whole shard goes in at once.
        out = models.engine.generate(prompt_ids, prompt_mask, gen, eos, pad)
        models.engine.sleep()  # GPU: free its memory for scoring and the update
        return out
    with models.generation_context() as (actor, keep_in_step):
        responses = [
            generate(actor, prompt_ids[s], prompt_mask[s], gen, tokenizer, keep_in_step, eos)
            for s in chunks
        ]
    width = max(r.shape[1] for r in responses)
    return torch.cat([pad_columns(r, width, pad) for r in responses]), None


def _score_chunk(models, sampled: dict, s: slice, prompts, texts, temperature, with_actor=True):
    """Old log-probs, entropies and values, reference log-probs and scores of the rows `s`
    of the rollout tensors `sampled`; with_actor=False leaves old log-probs and entropies
    None. Attention covers response_attention where a multi-turn rollout has it (tool
    tokens are context); log-probs, values and the score use response_mask."""
    prompt_ids, prompt_mask = sampled["prompt_ids"][s], sampled["prompt_mask"][s]
    response_ids, response_mask = sampled["response_ids"][s], sampled["response_mask"][s]
    attended = sampled.get("response_attention")
    attended = response_mask.long() if attended is None else attended[s]
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, attended], dim=1)
    old_logprobs, entropy, values = models.actor_critic(
        input_ids, attention_mask, response_mask, temperature, with_entropy=True,
        with_actor=with_actor,
    )  # fmt: skip
    if models.reference is not None:
        ref_logprobs, _ = token_logprobs(
            models.reference,
            input_ids,
            attention_mask,
            response_mask,
            temperature,
            prompt_width=prompt_ids.shape[1],
        )
    else:  # no reference: KL 0 (ref = old; with the skip, filled in after the update)
        ref_logprobs = None if old_logprobs is None else old_logprobs.clone()
    last = sequence_last_index(prompt_ids.shape[1], response_mask)
    raw_scores = models.scorer(prompts, texts, input_ids, attention_mask, last)
    return {
        "old_logprobs": old_logprobs,
        "ref_logprobs": None if ref_logprobs is None else ref_logprobs.float(),
        "old_values": None if values is None else values.float(),
        "raw_scores": raw_scores.float(),
        "entropy": entropy,
    }


def _engine_sample(engine, pad: int, ids, mask, gen, stop_ids):
    """One turn sampled by the vLLM engine: (ids (B, T), sampler log-probs (B, T))."""
    return engine.generate(ids, mask, gen, stop_ids, pad)


def describe_batch(tokenizer, batch: RolloutBatch, texts: list[str], rows: int = 2) -> str:
    """The first rows of a rollout, token by token with masks (debug.print_first_batch):
    what the model saw (prompt, attention) and what the losses use (response_mask)."""
    lines = [
        "== first rollout batch (token | prompt attention or response_mask | old logp | ref logp)"
    ]
    for b in range(min(rows, batch.response_ids.shape[0])):
        lines.append(
            f"-- row {b}: score {float(batch.scores[b]):.4g}, finished {bool(batch.finished[b])}: {texts[b]!r}"
        )
        for t, m in zip(batch.prompt_ids[b].tolist(), batch.prompt_mask[b].tolist()):
            lines.append(f"   P {tokenizer.convert_ids_to_tokens(t)!s:>14} | {m}")
        for t in range(batch.response_ids.shape[1]):
            token = tokenizer.convert_ids_to_tokens(int(batch.response_ids[b, t]))
            m = int(batch.response_mask[b, t])
            # old log-probs are not known yet when the update's forward gives them
            old = float("nan") if batch.old_logprobs is None else float(batch.old_logprobs[b, t])
            ref = float(batch.ref_logprobs[b, t])
            lines.append(f"   R {token!s:>14} | {m} | {old:8.4f} | {ref:8.4f}")
    return "\n".join(lines)
