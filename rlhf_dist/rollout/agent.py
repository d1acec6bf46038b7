"""Multi-turn rollouts: the policy talks to tools or an environment (docs/agents.md,
"Multi-turn rollouts and tools").

An episode: the environment's first messages, rendered by the chat template (with the
tools' JSON schemas) -> the policy samples a turn (engine.decode.generate, until a stop token) ->
the environment answers it (a tool call is parsed and run; a tool message comes back) ->
the template's rendering of ONLY the new messages is appended to the ids sampled so far ->
the next turn ... until the environment is done, generation.max_turns or the episode's
token budget (generation.max_episode_tokens).

Token-in/token-out: the ids the policy sampled are never decoded and tokenised again;
a turn's prompt is the previous prompt + the sampled ids + the new messages' tokens. So
the sequence scored and trained on is exactly the one sampled (re-tokenising can merge or
split tokens: trl#5144). `response_mask` is True on sampled tokens only; tool and
environment tokens are attended to (`RolloutBatch.response_attention`) but never trained
on, nor counted in KL or entropy (docs/architecture.md section 3).

Lock-step (docs/architecture.md section 6): ranks may need different numbers of turns.
Every rank runs the same number of turns (one "any rank unfinished" all-reduce per turn),
a rank with nothing left generating a throw-away row while forwards are collectives.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeAlias, TypeVar

import torch
from torch import nn

from rlhf_dist.config import Config, ConfigError, GenerationConfig, PerfConfig
from rlhf_dist.data.chat import BadRow, Chat, resolve_template
from rlhf_dist.data.inputs import accepted_columns, resolve_callable
from rlhf_dist.data.rows import Text
from rlhf_dist.data.vision import (
    Media,
    RowMedia,
    VisionInputs,
    join_media,
    message_images,
    row_images,
)
from rlhf_dist.engine.decode import KeepInStep, generate
from rlhf_dist.engine.forward import DEFAULT_PERF
from rlhf_dist.errors import UserError
from rlhf_dist.models.vision import policy_vision

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rlhf_dist.generation.server import ServerEngine
    from rlhf_dist.rollout.batch import RolloutBatch

V = TypeVar("V")
ToolCall: TypeAlias = tuple[str, dict[str, Any]]  # (tool name, keyword arguments)


class TurnSampler(Protocol):
    """sample(ids, mask (B, L) left-padded, gen, stop_ids[, media]) -> (ids (B, T), the
    sampler's log-probs (B, T) or None): one turn of every active episode; media, passed
    for a vision policy only: the pixel inputs of each row's images so far."""

    def __call__(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        gen: GenerationConfig,
        stop_ids: Sequence[int],
        media: RowMedia | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...


TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class ToolCallError(Exception):
    """A tool call that cannot be run; its message goes back to the model."""


def parse_tool_call(text: str) -> ToolCall | None:
    """(name, arguments) of the first `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
    in a turn's text (the Hermes / Qwen format); None when the turn calls no tool. A
    malformed call raises ToolCallError."""
    found = TOOL_CALL.search(text)
    return None if found is None else _checked_call(_json(found.group(1)))


def requested_call(message: dict[str, Any]) -> ToolCall | None:
    """(name, arguments) of the tool a turn calls: its first OpenAI `tool_calls` entry (as
    the rollout servers' endpoint answers, serve.tool_call_parser), else the first
    `<tool_call>` block of its text; None when it calls none. A malformed call raises
    ToolCallError."""
    calls = message.get("tool_calls")
    if not calls:
        return parse_tool_call(message.get("content") or "")
    function = calls[0].get("function") or {}
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        arguments = _json(arguments)
    return _checked_call({"name": function.get("name"), "arguments": arguments})


def _json(text: str) -> Any:
    """The JSON value of a tool call's text; invalid JSON is a ToolCallError."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ToolCallError(f"the tool call is not valid JSON ({e.msg})") from None


def _checked_call(call: Any) -> ToolCall:
    """(name, arguments) of a decoded tool call, which must be {"name": str,
    "arguments": dict}; anything else is a ToolCallError."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ToolCallError('a tool call needs {"name": ..., "arguments": {...}}')
    arguments = call.get("arguments", {})
    if not isinstance(arguments, dict):
        raise ToolCallError("the tool call's arguments must be a JSON object")
    return call["name"], arguments


def run_tool(fn: Callable, arguments: dict, timeout_s: float) -> tuple[str | list[dict], bool]:
    """(content for the model, whether it is an error) of fn(**arguments), run in a daemon
    thread for at most timeout_s seconds. An exception or a timeout becomes an error text,
    never a crash (a timed-out call is abandoned, still running in its thread). The
    content is `tool_content` of the result: a text, or parts holding an image."""
    result: dict = {}

    def call() -> None:
        try:
            result["value"] = fn(**arguments)
        except Exception as e:  # the tool's own failure: the model reads it
            result["error"] = f"{type(e).__name__}: {e}"

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        return f"error: the tool timed out after {timeout_s:g} s", True
    if "error" in result:
        return f"error: {result['error']}", True
    return tool_content(result.get("value"))


def tool_content(value: Any) -> tuple[str | list[dict], bool]:
    """(a tool message's content, whether it is an error) of a tool's result: a text as it
    is; an image (a PIL image) as one image part; a list of content parts (text and image
    parts, as TRL and OpenAI tool messages carry them), or a message holding one as its
    "content", as those parts when one is an image (a vision-language policy sees them:
    `observed`); anything else as its JSON text, an error text when it has none."""
    if isinstance(value, str):
        return value, False
    if hasattr(value, "getpixel"):  # a PIL image
        return [{"type": "image", "image": value}], False
    parts = value.get("content") if isinstance(value, dict) else value
    image = isinstance(parts, list) and _has_image([{"content": parts}])
    if isinstance(parts, list) and image and all(_is_part(p) for p in parts):
        return list(parts), False
    try:
        return json.dumps(value), False
    except (TypeError, ValueError) as e:
        return f"error: the tool's result is not JSON ({e})", True


# content parts that hold an image: TRL's {"type": "image", "image": ...} and OpenAI's
# {"type": "image_url", "image_url": {"url": "data:image/...;base64,..."}}
IMAGE_PARTS = ("image", "image_url")


def _is_part(part: Any) -> bool:
    """Whether `part` is a content part: {"type": "text" | "image" | "image_url", ...}."""
    return isinstance(part, dict) and part.get("type") in ("text", *IMAGE_PARTS)


def _has_image(messages: Sequence[dict]) -> bool:
    """Whether a message's list-of-parts content holds an image part."""
    return any(
        isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") in IMAGE_PARTS for p in m["content"])
        for m in messages
    )


def tool_schema(fn: Callable, key: str = "generation.tools") -> dict:
    """The JSON schema a chat template renders for `fn`: its `schema` attribute when it has
    one, else transformers' reading of its signature and Google-style docstring."""
    schema = getattr(fn, "schema", None)
    if isinstance(schema, dict):
        return schema
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:
        raise ConfigError(
            f"{key}: no JSON schema for {getattr(fn, '__name__', fn)!r} ({e}); give it type "
            "hints and an Args: docstring, or a `schema` dict attribute"
        ) from None


class Environment(Protocol):
    """What generation.environment's factory returns, one per episode (docs/agents.md):
    the episode's first messages, then per policy turn (new messages, done, reward or None)."""

    def reset(self, prompt: str | list[dict]) -> list[dict]: ...
    def step(self, messages: list[dict]) -> tuple[list[dict], bool, float | None]: ...


class ToolEnvironment:
    """The environment of plain tools: a turn with a tool call gets the tool's result as a
    tool message; a turn without one ends the episode (reward: reward.function / model)."""

    def __init__(self, tools: dict[str, Callable[..., Any]], timeout_s: float) -> None:
        self.tools, self.timeout_s = tools, timeout_s
        self.tool_errors = 0

    def reset(self, prompt: Text) -> list[dict]:
        """The prompt as the episode's first messages (a text: one user message)."""
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt}]
        return [dict(m) for m in prompt]

    def step(self, messages: list[dict]) -> tuple[list[dict], bool, float | None]:
        """The called tool's answer as a tool message; a turn without a call ends the
        episode. No reward: the run's reward function scores the episode."""
        try:
            call = requested_call(messages[-1])
            if call is None:
                return [], True, None
            name, arguments = call
            if name not in self.tools:
                raise ToolCallError(f"unknown tool {name!r} (tools: {', '.join(self.tools)})")
            text, failed = run_tool(self.tools[name], arguments, self.timeout_s)
        except ToolCallError as e:
            text, failed = f"error: {e}", True
        self.tool_errors += failed
        return [{"role": "tool", "content": text}], False, None


@dataclass(frozen=True)
class Renderer(Chat):
    """The chat template and the tools' schemas every turn is rendered with
    (data.chat.Chat), and the ids of a turn's new messages (`continuation_ids`)."""

    def continuation_ids(self, messages: list[dict], new: list[dict]) -> list[int]:
        """Tokens of ONLY the new messages and the next generation prompt, after a
        conversation whose last (assistant) turn ends at its stop token: the rendering
        with `new` minus the rendering without it, cut after the turn's last non-space
        character (the sampled turn ends at its end-of-turn token, so the separator after
        it, verl#6921, is part of the new tokens)."""
        closed = self.render(messages, generation_prompt=False).rstrip()
        full = self.render(messages + new, generation_prompt=True)
        if not full.startswith(closed):
            raise ConfigError(
                "data.chat_template: the template does not render earlier turns as a prefix "
                "of later ones (multi-turn rollouts need that)"
            )
        return self.encode(full[len(closed) :])


@dataclass(frozen=True)
class Agent:
    """What a multi-turn rollout needs: a fresh environment per episode, the renderer and
    the limits (generation.max_turns, max_episode_tokens)."""

    new_environment: Callable[[], Environment]
    renderer: Renderer
    max_turns: int
    max_episode_tokens: int
    # no reward source is set (validation.py): every episode's reward is the environment's
    reward_required: bool = False
    # a vision-language policy's processor (data/vision.py): images in the messages are
    # observations (`observed`); None: a text policy, to which an image is an error
    vision: VisionInputs | None = None
    # episodes played by this process (EndpointAgent: through the servers' chat endpoint)
    through_endpoint: ClassVar[bool] = False


def environment_rewards_only(cfg: Config) -> bool:
    """Whether generation.environment is the run's only reward source (no reward function,
    remote reward, judge or reward model): each episode must then return its reward."""
    r = cfg.reward
    return bool(cfg.generation.environment) and not (r.text_rewards() or cfg.model.reward)


def build_agent(cfg: Config, tokenizer: PreTrainedTokenizerBase) -> Agent | None:
    """The Agent generation.tools / generation.environment ask for; None when neither,
    or when the environment plays through the endpoint (rollout/endpoint.py)."""
    g = cfg.generation
    if not (g.tools or g.environment) or g.environment_endpoint:
        return None
    where = "generation.tools" if g.tools else "generation.environment"
    template = resolve_template(tokenizer, cfg.data.chat_template, where)
    schemas: tuple[dict, ...] = ()  # the tools' JSON schemas for the template
    if g.environment:
        factory = resolve_callable(g.environment, "generation.environment")
    else:
        tools = {}
        for spec in g.tools:
            fn = resolve_callable(spec, "generation.tools")
            tools[getattr(fn, "__name__", spec.rpartition(":")[2])] = fn
        schemas = tuple(tool_schema(fn) for fn in tools.values())

        def factory() -> ToolEnvironment:
            return ToolEnvironment(tools, g.tool_timeout_s)

    renderer = Renderer(tokenizer, template, schemas)
    if schemas and not renderer.shows_tools():
        raise ConfigError(
            "data.chat_template: the chat template does not show the tools to the model "
            "(it ignores `tools`); set data.chat_template: chatml_tools, or a template that does"
        )
    budget = g.max_episode_tokens or g.max_turns * g.max_new_tokens
    vision = policy_vision(cfg, samples=True)
    return Agent(factory, renderer, g.max_turns, budget, environment_rewards_only(cfg), vision)


@dataclass
class Episode:
    """One conversation in progress. `tokens` is everything after the prompt (sampled turns
    and environment messages, as ids); `sampled[t]` says whether the policy sampled it."""

    env: Environment | None  # None: played through the servers' endpoint (endpoint.py)
    messages: list[dict]
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    done: bool = False
    finished: bool = False  # ended by the environment, not by a limit
    reward: float | None = None
    answer: str = ""  # the last assistant turn's text
    sampler_logprobs: list[float] = field(default_factory=list)  # vLLM: per token, 0 on context
    # a vision policy's pixel inputs of the episode's images, in the order their tokens
    # appear (the prompt's, then each observation's): every forward over it takes them all
    media: list[Media] = field(default_factory=list)
    # why the episode was skipped (an observation's image unreadable: `advance`); "" if not
    skipped: str = ""

    def pixel_inputs(self) -> Media | None:
        """The episode's images' pixel inputs joined in order (None: no image)."""
        return join_media(self.media) or None


def start_episode(agent: Agent, prompt: Text, columns: dict | None = None) -> Episode:
    """A fresh environment reset with the prompt, and with those of the row's other
    columns that its `reset` names (or all, with **kwargs): an answer to check against,
    a task's state."""
    env = agent.new_environment()
    messages = env.reset(prompt, **accepted_columns(env.reset, columns or {}, ("prompt",)))
    media: list[Media] = []
    try:  # a vision run: the row's images (its image / images columns) and any the
        # environment adds to the first messages (`observed`)
        given = [] if agent.vision is None else row_images(columns or {})
        messages, images = observed(agent, messages, given)
        ids = agent.renderer.prompt_ids(messages)
        if images:
            ids, pixels = expanded(agent, ids, images)
            media.append(pixels)
    except BadRow as e:
        raise UserError(f"generation.environment: an episode's first messages: {e}") from None
    return Episode(env, messages, ids, media=media)


def observed(
    agent: Agent, messages: list[dict], given: Sequence[Any] = ()
) -> tuple[list[dict], list[Any]]:
    """(messages, their images in order): for a vision policy each image part (a tool's or
    environment's observation, or one of `given`, the prompt row's images) as the
    processor's placeholder text (data/vision.py `message_images`; BadRow for an
    unreadable image); a text policy's as they are, where an image is a UserError."""
    if agent.vision is not None:
        return message_images(messages, agent.vision.placeholder, given)
    if _has_image(messages):
        raise UserError(
            "generation.tools/environment: a tool or environment returned an image, and "
            "model.policy is not a vision-language model (docs/vision.md)"
        )
    return messages, []


def expanded(agent: Agent, ids: list[int], images: list[Any]) -> tuple[list[int], Media]:
    """(ids with each image placeholder replaced by its image's tokens, their pixel inputs)
    (VisionInputs.expand; BadRow)."""
    assert agent.vision is not None  # images only for a vision policy (`observed`)
    ids, _, media = agent.vision.expand(ids, [False] * len(ids), images)
    assert media is not None
    return ids, media


def run_episodes(
    agent: Agent,
    actor: nn.Module | None,
    keep_in_step: KeepInStep | None,
    prompts: Sequence[Text],
    gen: GenerationConfig,
    tokenizer: PreTrainedTokenizerBase,
    stop_ids: Sequence[int],
    any_rank: Callable[[bool], bool] | None = None,
    sampler: TurnSampler | None = None,
    perf: PerfConfig = DEFAULT_PERF,
    columns: list[dict] | None = None,
    sampler_in_step: bool = False,
) -> list[Episode]:
    """Play one episode per prompt, all rows of a turn in one `engine.decode.generate` call over
    `actor` (or one `sampler(ids, mask, gen) -> (ids, logprobs)` call: the vLLM engine, the
    rollout servers).

    any_rank (several ranks): every rank runs as many turns as the busiest one; a rank whose
    episodes are all done runs a throw-away one-token generate while its forwards are
    collectives (keep_in_step not None), so ZeRO-3's per-layer gathers stay matched, or a
    throw-away one-token sample when the sampler's calls are (`sampler_in_step`: the
    servers' answers are awaited on every rank together).
    columns: each prompt's row's other columns, for the environments' reset."""
    columns = columns or [{} for _ in prompts]
    episodes = [start_episode(agent, p, c) for p, c in zip(prompts, columns, strict=True)]
    for _ in range(agent.max_turns):
        active = [e for e in episodes if not e.done]
        if not (any_rank(bool(active)) if any_rank is not None else active):
            break
        if active:
            hf = functools.partial(_hf_sample, actor, keep_in_step, tokenizer, perf)
            sample = sampler or hf
            sample_turn(agent, sample, active, gen, tokenizer, stop_ids)
        elif sampler is not None and sampler_in_step:
            filler = torch.full((1, 1), tokenizer.pad_token_id)
            sampler(filler, torch.ones_like(filler), _throw_away(gen), stop_ids)
        elif keep_in_step is not None:
            filler = torch.full((1, 1), tokenizer.pad_token_id, device=_device(actor))
            generate(
                actor,
                filler,
                torch.ones_like(filler),
                _throw_away(gen),
                tokenizer,
                keep_in_step,
                stop_ids,
                perf,
            )
    return episodes


def request_episodes(
    agent: Agent,
    server: ServerEngine,
    prompts: Sequence[Text],
    columns: list[dict],
    gen: GenerationConfig,
    tokenizer: PreTrainedTokenizerBase,
    stop_ids: Sequence[int],
) -> Callable[[], list[Episode]]:
    """The episodes of `prompts` played here, every turn sampled by the rollout servers
    (`server`, synced), named now and played when the returned work runs: at once, or
    with ppo.max_staleness on generation/prefetch.py's worker thread while the trainer
    trains. No collective inside (the servers' answers are not awaited in step; the
    ranks agree on failures around the whole work), so it may run on any thread. The
    turns' seeds come from a generator seeded now from torch's global RNG (checkpointed:
    a resumed run samples what the unbroken one did, whatever the main thread draws while
    the work runs). Every turn must come back with the servers' version when the work
    starts, else ServerError: nothing syncs while the episodes play, so every token of the
    rollout is that version's. `agent` and `tokenizer` must be the work's own (copies: a
    fast tokenizer is not shared across threads)."""
    seed = int(torch.randint(0, 2**62, (1,), dtype=torch.long))
    pad = tokenizer.pad_token_id

    def work() -> list[Episode]:
        version, generator = server.version, torch.Generator().manual_seed(seed)

        def turn(
            ids: torch.Tensor,
            mask: torch.Tensor,
            gen: GenerationConfig,
            stop_ids: Sequence[int],
            media: RowMedia | None = None,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            answers = server.request(ids, mask, gen, stop_ids, media=media, generator=generator)()
            return server.responses(answers, version, pad, ids.device)

        return run_episodes(
            agent, None, None, prompts, gen, tokenizer, stop_ids, sampler=turn, columns=columns
        )

    return work


def _throw_away(gen: GenerationConfig) -> GenerationConfig:
    """A one-token turn for a rank with no episode left (kept in step with the others)."""
    return dataclasses.replace(gen, max_new_tokens=1, min_new_tokens=0)


def _hf_sample(
    actor: nn.Module,
    keep_in_step: KeepInStep | None,
    tokenizer: PreTrainedTokenizerBase,
    perf: PerfConfig,
    ids: torch.Tensor,
    mask: torch.Tensor,
    gen: GenerationConfig,
    stop_ids: Sequence[int],
    media: RowMedia | None = None,
) -> tuple[torch.Tensor, None]:
    """(ids (B, T), None) of engine.decode.generate over `actor` (the trainer's own
    sampler); media: the rows' pixel inputs, which its prefill takes."""
    ids, mask = ids.to(_device(actor)), mask.to(_device(actor))
    pixels = None if media is None else media.joined()
    out = generate(actor, ids, mask, gen, tokenizer, keep_in_step, stop_ids, perf, media=pixels)
    return out, None


def _device(model: nn.Module) -> torch.device:
    """Where `model`'s first parameter lives (CPU for a model without parameters)."""
    return next(iter(model.parameters()), torch.empty(0)).device


def sample_turn(
    agent: Agent,
    sample: TurnSampler,
    active: list[Episode],
    gen: GenerationConfig,
    tokenizer: PreTrainedTokenizerBase,
    stop_ids: Sequence[int],
) -> None:
    """One turn of every active episode: its context (prompt + all ids so far, exactly as
    sampled) left-padded into one batch, sampled until a stop token, then `advance`d. The
    turn is capped at generation.max_new_tokens and at what is left of the episode's
    budget. sample(ids, mask, gen, stop_ids, media) -> (ids (B, T), sampler log-probs or
    None); media: a vision policy's pixel inputs of each episode's images so far."""
    room = [agent.max_episode_tokens - len(e.tokens) for e in active]
    cap = min(gen.max_new_tokens, max(room))
    turn_gen = dataclasses.replace(
        gen, max_new_tokens=cap, min_new_tokens=min(gen.min_new_tokens, cap)
    )
    ids, mask = left_pad([e.prompt + e.tokens for e in active], tokenizer.pad_token_id)
    if agent.vision is None:  # a sampler written before images keeps working
        out, logprobs = sample(ids, mask, turn_gen, stop_ids)
    else:
        media = RowMedia(tuple(e.pixel_inputs() for e in active), agent.vision.image_token_id)
        out, logprobs = sample(ids, mask, turn_gen, stop_ids, media)
    logprobs = [None] * len(active) if logprobs is None else logprobs.tolist()
    for e, row, lp, r in zip(active, out.tolist(), logprobs, room):
        advance(agent, e, row[:r], tokenizer, stop_ids, lp)


def advance(
    agent: Agent,
    e: Episode,
    row: list[int],
    tokenizer: PreTrainedTokenizerBase,
    stop_ids: Sequence[int],
    logprobs: list[float] | None = None,
) -> None:
    """Append a sampled turn (up to and including its first stop token) to the episode,
    let the environment answer it, and append the tokens of the answer (context: not in
    response_mask). A turn without a stop token (cut by a limit, or before a sampled image
    token of a vision policy, for which no image exists), max_turns reached or no room
    left for the answer and a next turn: the episode ends truncated. An answer holding an
    unreadable image: the episode ends, skipped (`Episode.skipped`)."""
    stops = {int(s) for s in torch.as_tensor(stop_ids).reshape(-1).tolist()}
    if agent.vision is not None and agent.vision.image_token_id in row:
        row = row[: row.index(agent.vision.image_token_id)]  # never fed (engine/decode.py)
    end = next((i for i, t in enumerate(row) if t in stops), None)
    turn = row if end is None else row[: end + 1]
    e.tokens += turn
    e.sampled += [True] * len(turn)
    if logprobs is not None:  # the engine's log-prob of each sampled token
        e.sampler_logprobs += [0.0] * (len(e.tokens) - len(turn) - len(e.sampler_logprobs))
        e.sampler_logprobs += logprobs[: len(turn)]
    e.turns += 1
    e.answer = tokenizer.decode([t for t in turn if t not in stops], skip_special_tokens=True)
    e.messages.append({"role": "assistant", "content": e.answer})
    if end is None:
        e.done = True
        return
    assert e.env is not None  # episodes played here have their environment
    new, done, reward = e.env.step(list(e.messages))
    new = list(new)
    e.tool_calls += sum(m.get("role") == "tool" for m in new)
    if done:
        e.done, e.finished, e.reward = True, True, reward
        return
    observation = None if e.turns >= agent.max_turns else _observation(agent, e, new)
    if observation is None or len(e.tokens) + len(observation[1]) >= agent.max_episode_tokens:
        e.done = True  # the conversation ends with the policy's turn, as scored
        return
    new, more, media = observation
    e.messages += new
    e.tokens += more
    e.sampled += [False] * len(more)
    e.media += [media] if media is not None else []


def _observation(
    agent: Agent, e: Episode, new: list[dict]
) -> tuple[list[dict], list[int], Media | None] | None:
    """(the environment's answer `new` as the conversation keeps it, its tokens after the
    episode's messages (`Renderer.continuation_ids`), with each image's tokens in place of
    its placeholder, and those images' pixel inputs or None), or None: no tokens, or an
    image that cannot be read or placed (data/vision.py BadRow), which ends the episode
    skipped with the reason (`Episode.skipped`)."""
    try:
        new, images = observed(agent, new)
        more = agent.renderer.continuation_ids(e.messages, new)
        media = None
        if images and more:
            more, media = expanded(agent, more, images)
    except BadRow as err:
        e.skipped = f"an observation's image: {err}"
        return None
    return (new, more, media) if more else None


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask), both (B, max length): rows left-padded with pad_id, mask 1 on tokens."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
    return ids, mask


def episode_batch(
    episodes: list[Episode], pad_id: int, device: torch.device | str
) -> dict[str, torch.Tensor]:
    """The episodes as rollout tensors: prompt_ids/prompt_mask (B, P) left-padded;
    response_ids (B, T) (PAD after the end), response_mask (B, T) bool True on sampled
    tokens only, response_attention (B, T) long 1 on every token of the episode;
    finished, skipped_episodes (B,) bool; turns, tool_calls, tool_errors (B,) long;
    env_scores (B,) float (NaN where the environment gave no reward)."""
    prompt_ids, prompt_mask = left_pad([e.prompt for e in episodes], pad_id)
    T = max(1, max(len(e.tokens) for e in episodes))

    def right(values: list[list[V]], fill: V) -> list[list[V]]:
        return [v + [fill] * (T - len(v)) for v in values]

    out = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "response_ids": torch.tensor(right([e.tokens for e in episodes], pad_id)),
        "response_mask": torch.tensor(right([e.sampled for e in episodes], False)),
        "response_attention": torch.tensor(right([[1] * len(e.tokens) for e in episodes], 0)),
        "finished": torch.tensor([e.finished for e in episodes]),
        "skipped_episodes": torch.tensor([bool(e.skipped) for e in episodes]),
        "turns": torch.tensor([e.turns for e in episodes]),
        "tool_calls": torch.tensor([e.tool_calls for e in episodes]),
        "tool_errors": torch.tensor([getattr(e.env, "tool_errors", 0) for e in episodes]),
        "env_scores": torch.tensor(
            [float("nan") if e.reward is None else float(e.reward) for e in episodes]
        ),
    }
    if any(e.sampler_logprobs for e in episodes):  # (B, T), 0 outside the sampled tokens
        lp = [
            e.sampler_logprobs + [0.0] * (len(e.tokens) - len(e.sampler_logprobs)) for e in episodes
        ]
        out["sampler_logprobs"] = torch.tensor(right(lp, 0.0))
    return {k: v.to(device) for k, v in out.items()}


def scoring_inputs(episodes: list[Episode]) -> tuple[list[Text], list[str]]:
    """What reward.function reads of each episode: (the conversation before the final
    answer, as a message list; the final assistant turn's text)."""
    return [e.messages[:-1] for e in episodes], [e.answer for e in episodes]


def episode_stats(batch: RolloutBatch) -> dict[str, tuple[torch.Tensor, int]]:
    """name -> (sum over this rank's episodes, count) of the multi-turn rollout metrics,
    from a multi-turn batch's (B,) turns, tool_calls, tool_errors and finished."""
    assert batch.turns is not None and batch.tool_calls is not None  # a multi-turn batch
    assert batch.tool_errors is not None
    B = batch.turns.shape[0]
    skipped = batch.skipped_episodes
    skipped = torch.zeros_like(batch.finished) if skipped is None else skipped
    return {
        "rollout/turns": (batch.turns.sum().float(), B),
        "rollout/tool_calls": (batch.tool_calls.sum().float(), B),
        "rollout/tool_errors": (batch.tool_errors.sum().float(), B),
        "rollout/truncated_episodes": ((~batch.finished).sum().float(), B),
        "rollout/skipped_episodes": (skipped.sum().float(), B),
    }
