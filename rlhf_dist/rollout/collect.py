"""Rollout: generate responses, then score them with every model PPO needs.

generate (actor, sampling, left-padded prompts) -> truncate after the first EOS ->
old_logprobs + old_values (actor-critic forward, training dtype; no values without a
critic) -> ref_logprobs -> teacher_logprobs (on-policy distillation) ->
scores (reward model at the last real token, or a Python reward function).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import torch

from rlhf_dist.config import Config, GenerationConfig, PerfConfig
from rlhf_dist.data.rows import Text
from rlhf_dist.data.vision import Media, RowMedia
from rlhf_dist.engine.cpu import scoring_context
from rlhf_dist.engine.decode import cut_before, decode_responses, truncate_after_eos
from rlhf_dist.engine.forward import DEFAULT_PERF, token_logprobs
from rlhf_dist.errors import UserError
from rlhf_dist.generation import HFSampler, Sampler
from rlhf_dist.generation.base import GenerationContext
from rlhf_dist.models.routing import RoutingSpan, recording, replaying, router_entropy
from rlhf_dist.rollout import agent as agent_mod
from rlhf_dist.rollout import endpoint
from rlhf_dist.rollout.batch import (
    PromptBatch,
    RolloutBatch,
    scores_with_eos_penalty,
    sequence_last_index,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

# (input_ids, attention_mask (B, P + T), response_mask (B, T), P) of a scoring chunk
ChunkInputs: TypeAlias = tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]


class SequenceScorer(Protocol):
    """What scores a rollout's sequences (rewards.scoring.Scorer): (B,) raw scores from
    the prompts and response texts, or from the token ids read at each row's last real
    token (a reward model)."""

    def __call__(
        self,
        prompts: list[Text],
        texts: list[str],
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        last_index: torch.Tensor,
        columns: list[dict],
        completion_ids: list[list[int]] | None = None,
    ) -> torch.Tensor: ...


@dataclass
class RolloutModels:
    """What a rollout reads: the (possibly wrapped) actor-critic for scoring, a context
    yielding (actor module, keep_in_step) for generation, the frozen reference, the scorer,
    the ids that end a response (models.policy_stop_ids; empty: the tokenizer's EOS),
    the frozen teacher of on-policy distillation (model.teacher; None without one),
    what samples the responses (a generation.Sampler: generation.make_sampler; None: the
    decode loop over the actor in generation_context, generation.HFSampler), a
    context in which the actor-critic's weights are whole (under ZeRO-3: gathered once,
    not layer by layer in every forward; a no-op elsewhere), for multi-turn rollouts
    the agent (rollout/agent.py) and the per-turn lock-step collective, and the speed
    paths of generation and scoring (perf); with sequence parallelism how scoring
    pools its chunks over the group and splits their forwards (`pool`, `split`)."""

    actor_critic: torch.nn.Module
    generation_context: GenerationContext
    reference: torch.nn.Module | None
    scorer: SequenceScorer
    stop_ids: tuple[int, ...] = ()
    sampler: Sampler = None  # type: ignore[assignment]  # None: HFSampler (__post_init__)
    whole_weights: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext
    # multi-turn rollouts (generation.tools / environment; an EndpointAgent when the
    # environment plays through the servers' endpoint)
    agent: agent_mod.Agent | endpoint.EndpointAgent | None = None
    # Runtime.any_rank with several ranks: turns in lock-step
    any_rank: Callable[[bool], bool] | None = None
    perf: PerfConfig = DEFAULT_PERF
    teacher: torch.nn.Module | None = None
    # distributed.sequence_parallel_size > 1: Runtime.pool_micro_batches and
    # Runtime.sequence_parallel, scoring's forwards split over the group; None: whole rows
    pool: Callable[[list[ChunkInputs]], list[tuple[bool, ChunkInputs]]] | None = None
    split: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext
    # whether actor_critic holds a critic: without one, scoring without the actor's pass
    # (old_logprobs=False) calls no actor_critic forward at all (under ZeRO-3 even an
    # empty forward fetches the top module's weights)
    has_critic: bool = True
    # ppo.routing_replay of a mixture-of-experts actor (docs/moe.md): r2 records the
    # scoring forward's routing, r3 replays the sampler's (Samples.routing) in it
    routing_replay: str = "none"
    # (agent, tokenizer) copies that episodes played through the servers use, maybe on
    # generation/prefetch.py's worker thread (collect.py `_served_episodes` makes them)
    worker_agent: tuple[agent_mod.Agent, Any] | None = None

    def __post_init__(self) -> None:
        if self.sampler is None:
            self.sampler = HFSampler(self.generation_context, self.perf)


@torch.no_grad()
def collect_rollout(
    models: RolloutModels,
    prompts: PromptBatch,
    cfg: Config,
    tokenizer: PreTrainedTokenizerBase,
    timings: dict[str, float] | None = None,
    micro_batch_size: int | None = None,
    old_logprobs: bool = True,
) -> tuple[RolloutBatch, list[str]]:
    """Generate and score one rank's prompts in rollout micro-batches -> RolloutBatch, and
    the response texts: generate -> truncate after EOS -> decode -> old/ref log-probs,
    values and scores (the scorer reads each row's other columns too) -> missing-EOS
    penalty. PPO's rollout and `rlhf-dist eval` alike.

    micro_batch_size: prompts per generation/scoring pass (None: ppo.rollout_micro_batch_size).
    old_logprobs=False: no actor pass in scoring (old_logprobs and entropy stay None; the
    update's first forward gives them, config/sizes.py::old_logprobs_from_update)."""
    gen = cfg.generation
    micro = micro_batch_size or cfg.ppo.rollout_micro_batch_size
    chunks = [slice(i, i + micro) for i in range(0, prompts.ids.shape[0], micro)]
    # hf: sampling and scoring in one span of whole weights (one gather under ZeRO-3).
    # vLLM samples from its own copy: whole weights only for its sync, then for scoring.
    hf = models.sampler.from_actor
    with models.whole_weights() if hf else contextlib.nullcontext():
        start = time.perf_counter()
        play = _single_turn if models.agent is None else _episodes  # episodes: agent.py
        sampled, score_prompts, texts, env_scores = play(models, prompts, gen, chunks, tokenizer)
        generated = time.perf_counter()
        # nested under hf: already whole. No gradients: the grouped KV heads go to CPU
        # attention uncopied, the same values (generate has its own context).
        with models.whole_weights(), scoring_context(models.perf):
            forwards = _scoring_forwards(models, sampled, chunks, gen.temperature, old_logprobs)
            parts = [
                _score_chunk(
                    models, sampled, s, (score_prompts[s], texts[s], prompts.rows(s)[1]), f
                )
                for s, f in zip(chunks, forwards)
            ]
    merged = {
        k: None if parts[0][k] is None else torch.cat([p[k] for p in parts]) for k in parts[0]
    }
    if env_scores is not None:  # the environment's reward where it gave one
        given = ~torch.isnan(env_scores)
        raw = torch.where(given, env_scores, merged["raw_scores"])
        # a skipped episode (rollout/agent.py) is unscored: the update leaves it out
        skipped = sampled["skipped_episodes"].to(env_scores.device)
        merged["raw_scores"] = raw.masked_fill(skipped, float("nan"))
    finished = sampled["finished"]
    scores = scores_with_eos_penalty(merged["raw_scores"], finished, cfg.reward.missing_eos_penalty)
    if timings is not None:  # seconds spent generating, and scoring with the four models
        timings |= {"generate": generated - start, "score": time.perf_counter() - generated}
    sampled.pop("sampler_routing", None)  # replayed in scoring: `merged` has what was used
    return RolloutBatch(scores=scores, **sampled, **merged), texts


def _single_turn(
    models: RolloutModels,
    prompts: PromptBatch,
    gen: GenerationConfig,
    chunks: list[slice],
    tokenizer: PreTrainedTokenizerBase,
) -> tuple[dict[str, Any], list[Text], list[str], None]:
    """One response per prompt -> (the rollout tensors, the prompts and response texts the
    scorer reads, None: no environment rewards)."""
    eos, pad = models.stop_ids or (tokenizer.eos_token_id,), tokenizer.pad_token_id
    response_ids, sampler_logprobs, routing = _sample(models, prompts, gen, chunks, tokenizer)
    if models.routing_replay == "r3" and routing is None:
        raise ValueError("ppo.routing_replay=r3: the sampler returned no routing")
    keep = prompts.ids.shape[1] + response_ids.shape[1]
    response_ids, response_mask, finished = truncate_after_eos(response_ids, eos, pad)
    if prompts.media is not None:  # a vision run: no image token in a response
        cut = cut_before(response_ids, response_mask, finished, prompts.media.image_token_id, pad)
        response_ids, response_mask, finished = cut
    texts = decode_responses(tokenizer, response_ids, response_mask, eos)
    sampled = {
        "prompt_ids": prompts.ids,
        "prompt_mask": prompts.mask,
        "response_ids": response_ids,
        "response_mask": response_mask,
        "finished": finished,
        "sampler_logprobs": sampler_logprobs,
        "media": prompts.media,
    }
    if routing is not None and models.routing_replay == "r3":  # scoring replays it
        sampled["sampler_routing"] = routing[:, :keep]
    return sampled, prompts.texts, texts, None


def _episodes(
    models: RolloutModels,
    prompts: PromptBatch,
    gen: GenerationConfig,
    chunks: list[slice],
    tokenizer: PreTrainedTokenizerBase,
) -> tuple[dict[str, Any], list[Text], list[str], torch.Tensor]:
    """Multi-turn episodes of every prompt, in rollout micro-batches -> (the rollout
    tensors of agent.episode_batch, what reward.function reads: the conversations before
    the final answers and the answers, the environment's rewards (B,), NaN where none).
    The data's prompt ids are not sampled from (an episode starts from the environment's
    first messages, rendered with the tools); vLLM's sync check reads them. Each episode's
    environment is reset with its row's other columns where it takes them."""
    eos = models.stop_ids or (tokenizer.eos_token_id,)
    assert models.agent is not None  # collect_rollout plays episodes only with an agent
    if models.agent.through_endpoint:
        episodes = _endpoint_episodes(models, prompts, gen, eos, tokenizer)
    else:
        episodes = _agent_episodes(models, prompts, gen, chunks, tokenizer, eos)
    if models.agent.reward_required:  # the same on every rank: the collective is safe
        _require_rewards(episodes, models.any_rank)
    skipped = Counter(e.skipped for e in episodes if e.skipped)
    if skipped:  # counted in rollout/skipped_episodes; why, here (this rank's)
        why = "; ".join(f"{n} {reason}" for reason, n in sorted(skipped.items()))
        log.warning("rollout: %d episodes skipped (%s)", sum(skipped.values()), why)
    device = next(iter(models.actor_critic.parameters())).device
    sampled: dict[str, Any] = agent_mod.episode_batch(episodes, tokenizer.pad_token_id, device)
    vision = models.agent.vision
    if vision is not None:  # each episode's images, in the order of their tokens
        media = tuple(e.pixel_inputs() for e in episodes)
        sampled["media"] = RowMedia(media, vision.image_token_id)
    env_scores = sampled.pop("env_scores")
    score_prompts, texts = agent_mod.scoring_inputs(episodes)
    return sampled, score_prompts, texts, env_scores


def _require_rewards(
    episodes: list[agent_mod.Episode], any_rank: Callable[[bool], bool] | None
) -> None:
    """With the environment as the run's only reward source, an episode that returned none
    stops every rank at once (any_rank: the ranks' agreement, None alone)."""
    unscored = [i for i, e in enumerate(episodes) if e.reward is None and not e.skipped]
    if any_rank(bool(unscored)) if any_rank is not None else unscored:
        where = f"episode {unscored[0]}" if unscored else "an episode of another rank"
        raise UserError(
            f"generation.environment: {where} returned no reward, and the run has no other "
            "reward source (reward.function, reward.functions, reward.url, reward.judge or "
            "model.reward)"
        )


def _endpoint_episodes(
    models: RolloutModels,
    prompts: PromptBatch,
    gen: GenerationConfig,
    eos: tuple[int, ...],
    tokenizer: PreTrainedTokenizerBase,
) -> list[agent_mod.Episode]:
    """generation.environment_endpoint: one sync, then the environment plays every episode
    against the servers' chat endpoint (rollout/endpoint.py); with ppo.max_staleness, the
    episodes played ahead by the last iteration's weights (generation/prefetch.py)."""
    sampler, agent = models.sampler, models.agent
    server = sampler.servers()
    assert server is not None and isinstance(agent, endpoint.EndpointAgent)
    sampler.sync(prompts.ids, prompts.mask, gen, eos, tokenizer)  # a bucket at a time

    def play(batch: PromptBatch) -> Callable[[], list[agent_mod.Episode]]:
        texts, columns = batch.rows(slice(None))
        return endpoint.request(agent, server, list(texts), columns, gen, eos)

    # an environment's error or a server's on one rank stops every rank at once
    return sampler.episodes(prompts, play)


def _agent_episodes(
    models: RolloutModels,
    prompts: PromptBatch,
    gen: GenerationConfig,
    chunks: list[slice],
    tokenizer: PreTrainedTokenizerBase,
    eos: tuple[int, ...],
) -> list[agent_mod.Episode]:
    """Episodes of generation.tools / environment, played by this process (rollout/agent.py)."""
    pad, agent = tokenizer.pad_token_id, models.agent
    assert isinstance(agent, agent_mod.Agent)
    play = functools.partial(
        agent_mod.run_episodes,
        agent,
        gen=gen,
        tokenizer=tokenizer,
        stop_ids=eos,
        any_rank=models.any_rank,
        perf=models.perf,
    )
    episodes, sampler = [], models.sampler
    if sampler.servers() is not None:  # every turn on the servers, maybe played ahead
        return _served_episodes(models, prompts, gen, tokenizer, eos)
    if sampler.from_actor:  # each turn decoded by the actor itself, a micro batch at a time
        with models.generation_context() as (actor, keep_in_step):
            for s in chunks:
                texts, columns = prompts.rows(s)
                episodes += play(actor, keep_in_step, texts, columns=columns)
    else:  # an engine schedules its own batches: the whole shard, every turn in one call
        sampler.sync(prompts.ids, prompts.mask, gen, eos, tokenizer)
        texts, columns = prompts.rows(slice(None))
        # a server's answers are awaited on every rank together: turns stay in step
        episodes = play(
            None,
            None,
            list(texts),
            sampler=functools.partial(_turn, sampler, pad),
            columns=columns,
            sampler_in_step=sampler.in_step,
        )
        sampler.sleep()  # GPU: free its memory for scoring and the update
    return episodes


def _served_episodes(
    models: RolloutModels,
    prompts: PromptBatch,
    gen: GenerationConfig,
    tokenizer: PreTrainedTokenizerBase,
    eos: tuple[int, ...],
) -> list[agent_mod.Episode]:
    """Episodes of generation.tools / environment played by this process, every turn
    sampled by the rollout servers: one sync, then the sampler's `episodes` (with
    ppo.max_staleness, the ones played ahead by an earlier iteration's weights on its
    worker, generation/prefetch.py; those `expect` named are started)."""
    sampler, server = models.sampler, models.sampler.servers()
    assert server is not None and isinstance(models.agent, agent_mod.Agent)
    if models.worker_agent is None:  # the worker's own tokenizer (not shared across threads)
        models.worker_agent = copy.deepcopy((models.agent, tokenizer))
    agent, own_tokenizer = models.worker_agent
    sampler.sync(prompts.ids, prompts.mask, gen, eos, tokenizer)  # a bucket at a time

    def play(batch: PromptBatch) -> Callable[[], list[agent_mod.Episode]]:
        texts, columns = batch.rows(slice(None))
        return agent_mod.request_episodes(
            agent, server, list(texts), columns, gen, own_tokenizer, eos
        )

    # a tool's error or a server's on one rank stops every rank at once
    return sampler.episodes(prompts, play)


def _sample(
    models: RolloutModels,
    prompts: PromptBatch,
    gen: GenerationConfig,
    chunks: list[slice],
    tokenizer: PreTrainedTokenizerBase,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Responses (B, T), PAD-padded, the sampler's log-probs (B, T) (None: the hf
    backend, whose sampler is the trainer's own forward) and its routing (B, P + T, L, k)
    (Samples.routing; None unless recorded); a vision run's prompts come with their pixel
    inputs (prompts.media)."""
    eos, pad = models.stop_ids or (tokenizer.eos_token_id,), tokenizer.pad_token_id
    sampler, prompt_ids, prompt_mask = models.sampler, prompts.ids, prompts.mask
    # the actor's weights, once per rollout (vLLM: whole; rollout servers: a bucket at a time)
    sampler.sync(prompt_ids, prompt_mask, gen, eos, tokenizer)
    # the decode loop samples a micro batch at a time; vLLM and the servers the whole shard
    micro = chunks[0].stop - chunks[0].start
    # images only where there are some: a Sampler written before images keeps working
    if prompts.media is None:
        samples = sampler.sample(prompt_ids, prompt_mask, gen, eos, pad, rows_per_pass=micro)
    else:
        media = prompts.media
        samples = sampler.sample(
            prompt_ids, prompt_mask, gen, eos, pad, rows_per_pass=micro, media=media
        )
    sampler.sleep()  # GPU: free its memory for scoring and the update
    return samples.response_ids, samples.logprobs, samples.routing


def _chunk_inputs(sampled: dict[str, Any], s: slice) -> ChunkInputs:
    """(input_ids, attention_mask (B, P + T), response_mask (B, T), P) of the rows `s` of
    the rollout tensors `sampled`. Attention covers response_attention where a multi-turn
    rollout has it (tool tokens are context); log-probs, values and the score use
    response_mask."""
    prompt_ids, prompt_mask = sampled["prompt_ids"][s], sampled["prompt_mask"][s]
    response_ids, response_mask = sampled["response_ids"][s], sampled["response_mask"][s]
    attended = sampled.get("response_attention")
    attended = response_mask.long() if attended is None else attended[s]
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, attended], dim=1)
    return input_ids, attention_mask, response_mask, prompt_ids.shape[1]


def _scoring_forwards(
    models: RolloutModels,
    sampled: dict[str, Any],
    chunks: list[slice],
    temperature: float,
    with_actor: bool,
) -> list[dict[str, torch.Tensor | None]]:
    """`_chunk_forwards` of every chunk of this rank's rollout, in order. With sequence
    parallelism (models.pool set) the ranks of a group pool their chunks and run each
    split by columns (distributed.sequence_parallel_size); each keeps its own chunks'."""
    inputs = [_chunk_inputs(sampled, s) for s in chunks]
    if models.routing_replay != "none":  # validation: no sequence parallelism with it
        return [_routed_chunk(models, sampled, x, s, temperature) for x, s in zip(inputs, chunks)]
    if models.pool is None:
        media = sampled.get("media")  # a vision run's pixel inputs, per row
        pixels = [None if media is None else media[s].joined() for s in chunks]
        return [
            _chunk_forwards(models, x, temperature, with_actor, media=p)
            for x, p in zip(inputs, pixels)
        ]
    mine: list[dict[str, torch.Tensor | None]] = []
    for own, x in models.pool(inputs):
        with models.split():
            forwards = _chunk_forwards(models, x, temperature, with_actor)
        if own:
            mine.append(forwards)
    return mine


def _routed_chunk(
    models: RolloutModels,
    sampled: dict[str, Any],
    inputs: ChunkInputs,
    s: slice,
    temperature: float,
) -> dict[str, torch.Tensor | None]:
    """`_chunk_forwards` of a mixture-of-experts actor under ppo.routing_replay, the actor's
    forward inside a routing span (models/routing.py): r2 records its routing, r3 replays
    the sampler's. Adds the routing the update replays (prompt_routing (b, P, L, k),
    response_routing (b, T, L, k)), each token's router entropy per layer (b, T, L) and,
    for r3, whether the trainer's own top-k differs from the sampler's (router_flips
    (b, T, L) bool) and, when the sampler gave log-probs, the actor's log-probs without
    the replay (unreplayed_logprobs (b, T), one more forward: the gap replay closes)."""
    input_ids, attention_mask, response_mask, P = inputs
    forced = sampled.get("sampler_routing")
    b = input_ids.shape[0]
    span = recording(True) if forced is None else replaying([forced[s]], True)
    out = _chunk_forwards(models, inputs, temperature, True, span)
    used = span.recorded(b)  # (b, P + T, L, k)
    entropy = torch.stack([router_entropy(x) for x in span.router_logits()], -1)
    out |= {
        "prompt_routing": used[:, :P],
        "response_routing": used[:, P:],
        "router_entropy": entropy.reshape(b, -1, entropy.shape[-1])[:, P:].float(),
    }
    if forced is not None:
        own, replayed = span.router_choice(b)[:, P:], forced[s][:, P:]
        known = (replayed >= 0).all(-1)
        out["router_flips"] = (own.sort(-1).values != replayed.sort(-1).values).any(-1) & known
        if sampled.get("sampler_logprobs") is not None:
            free, _, _ = models.actor_critic(
                input_ids, attention_mask, response_mask, temperature, with_critic=False
            )
            out["unreplayed_logprobs"] = free.float()
    return out


def _chunk_forwards(
    models: RolloutModels,
    inputs: ChunkInputs,
    temperature: float,
    with_actor: bool = True,
    routing: RoutingSpan | None = None,
    media: Media | None = None,
) -> dict[str, torch.Tensor | None]:
    """Old log-probs, entropies and values, reference and teacher log-probs of one chunk's
    `_chunk_inputs`, each (B, T) float32 (None: not computed); with_actor=False leaves old
    log-probs and entropies None; `routing`: the span the actor's forward runs in; media:
    the chunk's pixel inputs (a vision run), which the actor's and the reference's forwards
    take."""
    input_ids, attention_mask, response_mask, P = inputs
    args = (input_ids, attention_mask, response_mask, temperature)
    old_logprobs = entropy = values = None
    if with_actor or models.has_critic:
        old_logprobs, entropy, values = models.actor_critic(
            *args,
            with_entropy=True,
            with_actor=with_actor,
            media=media,
            **({} if routing is None else {"routing": routing}),
        )
    if models.reference is not None:
        ref_logprobs, _ = token_logprobs(
            models.reference, *args, prompt_width=P, perf=models.perf, media=media
        )
    else:  # no reference: KL 0 (ref = old; with the skip, filled in after the update)
        ref_logprobs = None if old_logprobs is None else old_logprobs.clone()
    teacher_logprobs = None
    if models.teacher is not None:  # scored like the reference, at the sampling temperature
        teacher_logprobs, _ = token_logprobs(
            models.teacher, *args, prompt_width=P, perf=models.perf
        )
    return {
        "old_logprobs": old_logprobs,
        "ref_logprobs": None if ref_logprobs is None else ref_logprobs.float(),
        "teacher_logprobs": None if teacher_logprobs is None else teacher_logprobs.float(),
        "old_values": None if values is None else values.float(),
        "entropy": entropy,
    }


def _score_chunk(
    models: RolloutModels,
    sampled: dict[str, Any],
    s: slice,
    read: tuple[list[Text], list[str], list[dict]],
    forwards: dict[str, torch.Tensor | None],
) -> dict[str, torch.Tensor | None]:
    """The rows `s`' `_chunk_forwards` (given) and their scores; read: (prompts, response
    texts, other columns) of those rows, what the scorer reads, with each response's
    sampled ids (completion_ids: its response_mask's tokens, up to and including the stop
    token; a multi-turn episode's tool tokens are not sampled); raw_scores (B,) float32."""
    input_ids, attention_mask, response_mask, P = _chunk_inputs(sampled, s)
    last = sequence_last_index(P, response_mask)
    prompts, texts, columns = read
    ids = [r[m.bool()].tolist() for r, m in zip(input_ids[:, P:], response_mask)]
    raw_scores = models.scorer(prompts, texts, input_ids, attention_mask, last, columns, ids)
    return forwards | {"raw_scores": raw_scores.float()}


def _turn(
    sampler: Sampler,
    pad: int,
    ids: torch.Tensor,
    mask: torch.Tensor,
    gen: GenerationConfig,
    stop_ids: Sequence[int],
    media: RowMedia | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One turn of every active episode (rollout/agent.py's `sampler`), sampled by the vLLM
    engine or the rollout servers: (ids (B, T), sampler log-probs (B, T)); media: a
    vision policy's pixel inputs of each episode's images so far."""
    if media is None:  # a Sampler written before images keeps working
        samples = sampler.sample(ids, mask, gen, stop_ids, pad)
    else:
        samples = sampler.sample(ids, mask, gen, stop_ids, pad, media=media)
    return samples.response_ids, samples.logprobs
