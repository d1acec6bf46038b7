"""OpenAI-compatible /v1/completions and /v1/chat/completions over the served policy, for
environment libraries that drive a policy through such an endpoint (verifiers, OpenEnv).

The request fields of OpenAI's API that sampling uses are read (max_tokens or
max_completion_tokens, temperature, top_p, seed, n = 1) plus two extensions, top_k and
min_tokens; a prompt is a text or a list of token ids. Each choice carries, besides the
usual text, `token_ids` (the sampled ids, stop token included where it ended the
response), `prompt_token_ids` and OpenAI-style log-probs of every sampled token (those of
/generate: the trainer's at the sampling temperature), so a trainer gets the exact ids
back (token-in/token-out, no re-tokenisation: trl#5144). `policy_version` says which
weights sampled it. A chat prompt is rendered with data.chat_template or the tokenizer's
own template, with the generation prompt.

A chat request may carry `tools` (OpenAI function schemas, shown by the template). With
serve.tool_call_parser=hermes (the default) the answer's `<tool_call>{"name": ...,
"arguments": {...}}</tool_call>` blocks (the Hermes / Qwen / SmolLM2 format, as vLLM's
`hermes` parser reads it) then come back as OpenAI `tool_calls` with finish reason
"tool_calls", and the rest of the text as `content` (None when nothing else was
written): what tool-using environments (verifiers' ToolEnv) read. A malformed block
stays text: the environment sees what the policy wrote. Messages may carry `tool_calls`,
`tool_call_id` and `name`, and their content may be a list of text parts. A request may
name an episode in `model` (`<name>#<episode id>`): it is then one turn of that episode,
recorded token in, token out for the trainer (serving/episodes.py).

Refused with a 400: n > 1, `stop` strings (stop tokens are the model's; use the
extension `stop_token_ids`), a chat request when no template is known, tools when the
template does not show them (data.chat_template: chatml_tools does), an episode's turn
that does not extend its messages so far.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Any

from pydantic import BaseModel, Field

from rlhf_dist.data.vision import Media
from rlhf_dist.rollout.agent import TOOL_CALL, ToolCallError, parse_tool_call
from rlhf_dist.serving.batching import RequestBatcher
from rlhf_dist.serving.episodes import EpisodeLog, episode_of, turn_seed
from rlhf_dist.serving.images import chat_prompt
from rlhf_dist.serving.policy import BadRequest, PromptMedia, SamplingRequest, ServedPolicy


class OpenAISampling(BaseModel):
    model: str = ""
    max_tokens: int | None = Field(None, gt=0)
    max_completion_tokens: int | None = Field(None, gt=0)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    min_tokens: int = Field(0, ge=0)
    seed: int = Field(0, ge=0, lt=2**63)
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = []


class CompletionBody(OpenAISampling):
    prompt: str | list[int]


class Message(BaseModel):
    role: str = Field(min_length=1)
    content: str | list[dict] | None = None  # None: an assistant turn that only called tools
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None

    def as_dict(self, images: bool = False) -> dict:
        """The message as the chat template reads it: content as one text ("" for None);
        a tool call's arguments as a dict where they came as OpenAI's JSON text (Qwen's,
        Hermes' and Llama 3.1's templates write them with `tojson`: a string would be
        written quoted, as vLLM's server also avoids); BadRequest for a non-text content
        part. `images` (a vision-language model): a content with image_url parts stays
        a list of parts, for serving/images.py."""
        content = self.content
        if isinstance(content, list):
            kinds = {part.get("type") for part in content}
            if images and "image_url" in kinds:
                return self.model_dump(exclude_none=True)
            if kinds - {"text"}:
                what = "text and image_url" if images else "text"
                raise BadRequest(f"messages: only {what} content parts are supported")
            content = "".join(str(part.get("text", "")) for part in content)
        out = self.model_dump(exclude_none=True) | {"content": content or ""}
        if self.tool_calls:
            out["tool_calls"] = [_arguments_as_dict(call) for call in self.tool_calls]
        return out


def _arguments_as_dict(call: dict) -> dict:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    arguments = function["arguments"]
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return call  # left as the text it is: the template shows what was sent
    return call | {"function": function | {"arguments": parsed}}


class ChatBody(OpenAISampling):
    messages: list[Message] = Field(min_length=1)
    tools: list[dict] | None = None


def sampling_of(body: OpenAISampling, default_max: int) -> SamplingRequest:
    """The request's sampling keys; BadRequest for what is not supported."""
    if body.n != 1:
        raise BadRequest("n: only 1 completion per request")
    if body.stop:
        raise BadRequest("stop: stop strings are not supported; use stop_token_ids")
    max_new = body.max_completion_tokens or body.max_tokens or default_max
    return SamplingRequest(
        max_new_tokens=max_new,
        min_new_tokens=body.min_tokens,
        temperature=body.temperature,
        top_k=body.top_k,
        top_p=body.top_p,
        seed=body.seed,
        stop_token_ids=tuple(body.stop_token_ids),
    )


def completion(
    policy: ServedPolicy,
    body: CompletionBody,
    default_max: int,
    batcher: RequestBatcher | None = None,
) -> dict:
    """The text_completion answer to one /v1/completions request (`batcher`: sampled with
    concurrent ones, serve.batch_window_ms)."""
    s = sampling_of(body, default_max)
    if isinstance(body.prompt, str):
        prompt = policy.tokenizer(body.prompt, add_special_tokens=True)["input_ids"]
    else:
        prompt = list(body.prompt)
    out, text = _sample(policy, prompt, s, batcher)
    logprobs = {"tokens": out["tokens"], "token_logprobs": out["logprobs"]}
    choice = {"index": 0, "text": text, "finish_reason": out["finish"], "logprobs": logprobs}
    return _answer("text_completion", body.model or policy.name, choice, prompt, out)


def chat_completion(
    policy: ServedPolicy,
    body: ChatBody,
    default_max: int,
    episodes: EpisodeLog | None = None,
    tool_calls: bool = True,
    batcher: RequestBatcher | None = None,
) -> dict:
    """The chat.completion answer to one /v1/chat/completions request; a turn of an episode
    (`model` names one) continues and extends its record in `episodes`; `tool_calls`:
    tool-call blocks come back as OpenAI tool_calls (serve.tool_call_parser=hermes);
    `batcher`: sampled with concurrent requests (serve.batch_window_ms)."""
    if policy.chat is None or episodes is None:
        raise BadRequest("messages: the served tokenizer has no chat template (data.chat_template)")
    s = sampling_of(body, default_max)
    vision = policy.vision
    messages = [m.as_dict(vision is not None) for m in body.messages]
    tools = tuple(body.tools or ())
    if tools and not policy.chat.shows_tools():  # else the policy never sees what it may call
        raise BadRequest(
            "tools: the served chat template does not show tools to the model (it ignores "
            "`tools`); serve with data.chat_template: chatml_tools, or a template that does"
        )
    episode, media = episode_of(body.model), None
    if episode is None:
        chat = dataclasses.replace(policy.chat, tools=tools)
        prompt, media = chat_prompt(chat, vision, messages)
    else:
        prompt, turn, media = episodes.context(episode, messages, tools)
        s = dataclasses.replace(s, seed=turn_seed(s.seed, episode, turn))
    out, text = _sample(policy, prompt, s, batcher, media)
    message, finish = {"role": "assistant", "content": text}, out["finish"]
    if tool_calls and tools and out["finish"] == "stop":
        message = _with_tool_calls(text)
        finish = "tool_calls" if "tool_calls" in message else "stop"
    if episode is not None:
        episodes.answered(episode, out["ids"], out["logprobs"], text, out["version"], message)
    # every field of OpenAI's token log-prob, as clients that validate the answer require
    content = [
        {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
        for t, lp in zip(out["tokens"], out["logprobs"])
    ]
    choice = {
        "index": 0,
        "message": message,
        "finish_reason": finish,
        "logprobs": {"content": content},
    }
    return _answer("chat.completion", body.model or policy.name, choice, prompt, out)


def _with_tool_calls(text: str) -> dict:
    """The assistant message of a finished answer to a request with tools: its tool-call
    blocks as OpenAI `tool_calls`, the text around them as content (None if empty); the
    whole text as content when it calls nothing or a block is malformed."""
    calls = []
    for found in TOOL_CALL.finditer(text):
        try:
            call = parse_tool_call(found.group(0))
        except ToolCallError:
            return {"role": "assistant", "content": text}
        assert call is not None  # the block TOOL_CALL matched is a call
        name, arguments = call
        function = {"name": name, "arguments": json.dumps(arguments)}
        calls.append(
            {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": function}
        )
    if not calls:
        return {"role": "assistant", "content": text}
    rest = TOOL_CALL.sub("", text).strip()
    return {"role": "assistant", "content": rest or None, "tool_calls": calls}


def _sample(
    policy: ServedPolicy, prompt: list[int], s: SamplingRequest,
    batcher: RequestBatcher | None, media: Media | None = None,
) -> tuple[dict[str, Any], str]:  # fmt: skip
    """One response to `prompt` (with `media`, its images' pixel inputs) -> (its ids,
    per-token strings and log-probs, finish reason, version; the text without the stop
    token). A vision policy's response that samples the image token ends before it
    (finish "length"): no image exists for it, and an episode's next turn must not hold
    it."""
    pixels: PromptMedia = None if media is None else [media]
    got = (policy if batcher is None else batcher).generate([prompt], s, media=pixels)
    ids, finished, logprobs = got["responses"][0], got["finished"][0], got["logprobs"][0]
    image = None if policy.vision is None else policy.vision.image_token_id
    if image in ids:  # never fed (engine/decode.py): cut before it, as the rollout does
        ids, finished = ids[: ids.index(image)], False
        logprobs = logprobs[: len(ids)]
    kept = ids[:-1] if finished else ids  # the text ends before the stop token
    out = {
        "ids": ids,
        "tokens": policy.tokenizer.convert_ids_to_tokens(ids),
        "logprobs": logprobs,
        "finish": "stop" if finished else "length",
        "version": got["version"],
    }
    return out, policy.tokenizer.decode(kept, skip_special_tokens=True)


def _answer(kind: str, model: str, choice: dict, prompt: list[int], out: dict) -> dict:
    choice |= {"token_ids": out["ids"], "prompt_token_ids": prompt}
    usage = {
        "prompt_tokens": len(prompt),
        "completion_tokens": len(out["ids"]),
        "total_tokens": len(prompt) + len(out["ids"]),
    }
    return {
        "id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage,
        "policy_version": out["version"],
    }
