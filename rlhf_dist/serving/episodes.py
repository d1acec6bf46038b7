"""Episodes an environment plays through the OpenAI-compatible chat endpoint, recorded
token in, token out, for the trainer (docs/serving.md, "Environments behind the endpoint").

An environment library (verifiers, OpenEnv, one's own loop over an OpenAI client) drives
the policy with chat requests and never sees token ids. The trainer must train on exactly
the ids that were sampled, so the server keeps them: a request whose `model` ends in
`#<episode id>` (the name the trainer hands each episode) is one turn of that episode.
Its first request is rendered whole; every later one must repeat the episode's messages so
far (the assistant turns as the server answered them; compared by role, text and tool
calls, so ids, absent or empty content and a client's extra fields do not matter: the
same turn as verifiers or the `openai` client sends it back) and add new ones, whose tokens alone
are rendered (rollout/agent.py Renderer.continuation_ids) and appended after the ids
sampled so far: no earlier turn is decoded and re-tokenised (trl#5144). The trainer
collects the record (`collect`) once the episode is over: the prompt ids, the ids after
them, which of those the policy sampled, their log-probs and the policy version. For a
vision-language policy a message may carry images as OpenAI `image_url` parts (an
observation of the environment's, or the prompt's own): each becomes its tokens in place
(serving/images.py `episode_images`, as a chat request's), every turn is sampled with the
pixel inputs of all the episode's images so far, and the record carries them (`pixels`).

Each turn's seed is derived from the request's seed, the episode id and the turn's
index, so an episode samples the same tokens however the environment's requests
interleave with other episodes'.
"""

from __future__ import annotations

import contextlib
import json
import threading
import zlib
from dataclasses import dataclass, field
from typing import Any

from rlhf_dist.data.chat import BadRow, Chat
from rlhf_dist.data.vision import Media, VisionInputs, join_media
from rlhf_dist.generation.server import pixel_specs
from rlhf_dist.rollout.agent import Renderer
from rlhf_dist.serving.images import episode_images
from rlhf_dist.serving.policy import BadRequest

SEPARATOR = "#"  # `model` = "<name>#<episode id>"


@dataclass
class Record:
    """One episode so far: its messages (assistant turns as sampled, to render), how each
    reads when sent back (`seen`: `canonical`, assistant turns as answered), the prompt's
    ids, every id after the prompt, which of those were sampled, and their log-probs."""

    messages: list[dict]
    seen: list[tuple]
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: set[int] = field(default_factory=set)
    media: list[Media] = field(default_factory=list)  # its images' pixel inputs, in order

    def pixel_inputs(self) -> Media | None:
        """The pixel inputs of every image of the episode so far, joined in order."""
        return join_media(self.media) or None

    def answer(self) -> dict:
        return {
            "pixels": pixel_specs(self.pixel_inputs()),
            "messages": self.messages,
            "prompt_ids": self.prompt,
            "token_ids": self.tokens,
            "sampled": self.sampled,
            "logprobs": self.logprobs,
            "versions": sorted(self.versions),
        }


def canonical(message: dict) -> tuple:
    """What identifies a message sent back: role, text ("" for none) and tool calls (name,
    arguments as sorted JSON; a call's id is the client's business)."""
    calls = []
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        arguments = function.get("arguments") or {}
        if isinstance(arguments, str):
            with contextlib.suppress(json.JSONDecodeError):  # compared as the text it is
                arguments = json.loads(arguments)
        calls.append((function.get("name"), json.dumps(arguments, sort_keys=True)))
    return message["role"], message.get("content") or "", tuple(calls)


def episode_of(model: str) -> str | None:
    """The episode id a request's `model` names, or None (a plain request)."""
    name, sep, episode = model.rpartition(SEPARATOR)
    return episode if sep and name and episode else None


class EpisodeLog:
    """Every episode in progress on this server, by id (requests run on many threads)."""

    def __init__(self, chat: Chat, vision: VisionInputs | None = None):
        self.chat, self.vision, self.lock = chat, vision, threading.Lock()
        self.records: dict[str, Record] = {}

    def context(
        self, episode: str, messages: list[dict], tools: tuple
    ) -> tuple[list[int], int, Media | None]:
        """The ids the episode's next turn continues, the turn's index (0: the first) and
        the pixel inputs of the episode's images so far (None: none); BadRequest when
        `messages` do not extend the episode's messages so far."""
        render = Renderer(self.chat.tokenizer, self.chat.template, tools)
        with self.lock:
            record = self.records.get(episode)
        try:
            if record is None:
                flat, images = episode_images(self.vision, messages)
                ids, media = self._expanded(render.prompt_ids(flat), images)
                new = Record(list(flat), _seen(messages), ids, media=media)
                with self.lock:
                    self.records[episode] = new
                return ids, 0, new.pixel_inputs()
            known = len(record.messages)
            if _seen(messages[:known]) != record.seen or len(messages) == known:
                raise BadRequest(
                    f"messages: episode {episode!r} must repeat its {known} messages so far "
                    "(the assistant turns as answered) and add new ones"
                )
            flat, images = episode_images(self.vision, messages[known:])
            more, media = self._expanded(render.continuation_ids(record.messages, flat), images)
        except BadRow as e:
            raise BadRequest(f"messages: {e}") from None
        with self.lock:
            record.messages += flat
            record.seen += _seen(messages[known:])
            record.tokens += more
            record.sampled += [False] * len(more)
            record.logprobs += [0.0] * len(more)
            record.media += media
            turn = sum(m["role"] == "assistant" for m in messages)
            return record.prompt + record.tokens, turn, record.pixel_inputs()

    def _expanded(self, ids: list[int], images: list[Any]) -> tuple[list[int], list[Media]]:
        """(ids with each image placeholder replaced by its image's tokens, [their pixel
        inputs] or [] without images); BadRow (VisionInputs.expand)."""
        if self.vision is None or not images:
            return ids, []
        ids, _, media = self.vision.expand(ids, [False] * len(ids), images)
        return ids, [] if media is None else [media]

    def answered(
        self,
        episode: str,
        ids: list[int],
        logprobs: list[float],
        text: str,
        version: int,
        reply: dict[str, Any],
    ) -> None:
        """Append a sampled turn (stop token included), its text as an assistant message and
        the `reply` it was answered as (with tool calls, if parsed)."""
        with self.lock:
            record = self.records[episode]
            record.tokens += ids
            record.sampled += [True] * len(ids)
            record.logprobs += logprobs
            record.messages.append({"role": "assistant", "content": text})
            record.seen.append(canonical(reply))
            record.versions.add(version)

    def collect(self, episodes: list[str]) -> list[dict | None]:
        """The records of `episodes`, removed from the log (None: no request named it)."""
        with self.lock:
            records = [self.records.pop(e, None) for e in episodes]
        return [None if r is None else r.answer() for r in records]


def _seen(messages: list[dict]) -> list[tuple]:
    return [canonical(m) for m in messages]


def turn_seed(seed: int, episode: str, turn: int) -> int:
    """A turn's sampling seed from the request's, the episode id and the turn's index."""
    return zlib.crc32(f"{seed}:{episode}:{turn}".encode())
