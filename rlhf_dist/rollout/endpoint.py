"""Episodes whose environment drives the policy through the rollout servers' OpenAI-
compatible chat endpoint (generation.environment with generation.environment_endpoint;
docs/agents.md, "Environments behind the endpoint").

The environment is a function `episode(client, prompt, **columns) -> reward or None`, called
once per prompt row: it talks to the policy with chat requests to `client.base_url`
(any OpenAI client: `OpenAI(base_url=client.base_url, api_key=client.api_key)`, with
`model=client.model` and `**client.sampling`; or `client.chat(messages)`), runs its own
tools and rules, and returns the episode's reward (None: reward.function scores the final
answer). It never sees a token id. `verifiers:ENV_ID` names a verifiers environment
instead (rollout/environments.py). The `model` name carries the episode's id; the server
records each turn token in, token out (serving/episodes.py), and the trainer collects the
records once every episode of the rollout is over: exactly the sampled ids, which of them
the policy sampled, the log-probs they were sampled with and the policy version; for a
vision-language policy, whose environment sends images as OpenAI `image_url` parts, the
pixel inputs of the episode's images in the order of their tokens.

Episodes run on threads, `generation.endpoint_episodes_at_once` at a time, spread over
the servers; nothing here is a collective, so ranks need not keep in step.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, cast

from rlhf_dist.config import Config, GenerationConfig
from rlhf_dist.data.inputs import accepted_columns, resolve_callable
from rlhf_dist.data.rows import Text
from rlhf_dist.data.vision import VisionInputs
from rlhf_dist.errors import ServerError, UserError
from rlhf_dist.generation.server import tensor_of
from rlhf_dist.generation.vllm import sampling_seeds
from rlhf_dist.http_client import HTTPFailure, JSONClient
from rlhf_dist.models.vision import policy_vision
from rlhf_dist.rollout.agent import Episode, environment_rewards_only
from rlhf_dist.rollout.environments import EpisodeFunction, environment_episode

if TYPE_CHECKING:
    from rlhf_dist.generation.server import ServerEngine


@dataclass(frozen=True)
class EndpointAgent:
    """generation.environment as an episode function over the endpoint."""

    episode: EpisodeFunction
    at_once: int
    reward_required: bool = False  # as agent.Agent's
    vision: VisionInputs | None = None  # as agent.Agent's: a vision-language policy's
    through_endpoint: ClassVar[bool] = True  # the environment plays through the servers


def endpoint_agent(cfg: Config) -> EndpointAgent | None:
    """The EndpointAgent generation.environment_endpoint asks for, or None."""
    g = cfg.generation
    if not g.environment_endpoint:
        return None
    episode = environment_episode(g.environment) or resolve_callable(
        g.environment, "generation.environment"
    )
    vision = policy_vision(cfg, samples=True)
    return EndpointAgent(
        episode, g.endpoint_episodes_at_once, environment_rewards_only(cfg), vision
    )


@dataclass(frozen=True)
class EndpointClient:
    """What an episode function gets: where the policy answers and how to ask."""

    base_url: str  # http://host:port/v1
    api_key: str
    model: str  # "<policy>#<episode id>": the server records the episode under this id
    sampling: dict[str, Any]  # the run's generation keys as OpenAI request fields
    timeout_s: float = 600.0  # one request at most (distributed.timeout_s)
    # the pooled connections `chat` sends through (the servers' client's: ServerEngine.http);
    # None: a client of its own, made by the first call
    http: JSONClient | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.http is None:  # frozen: set once, here
            object.__setattr__(self, "http", JSONClient(self.timeout_s))

    @property
    def openai_fields(self) -> dict[str, Any]:
        """`sampling` as an `openai` client's create() takes it: the server's own fields
        (top_k, min_tokens, stop_token_ids) in extra_body."""
        extra = ("top_k", "min_tokens", "stop_token_ids")
        fields = {k: v for k, v in self.sampling.items() if k not in extra}
        return fields | {"extra_body": {k: self.sampling[k] for k in extra if k in self.sampling}}

    def chat(self, messages: list[dict], tools: list[dict] | None = None) -> dict:
        """One chat completion with the run's sampling keys -> the OpenAI answer (dict);
        the reply is answer["choices"][0]["message"]."""
        body = {"model": self.model, "messages": messages, **self.sampling}
        if tools:
            body["tools"] = tools
        assert self.http is not None  # __post_init__
        auth = {"Authorization": f"Bearer {self.api_key}"}
        url = self.base_url + "/chat/completions"
        try:  # an error answer keeps the server's reason, not just "Bad Request"
            return cast(dict, self.http.call(url, body, auth, detail_chars=500))
        except HTTPFailure as e:
            raise ServerError(f"{url}: {e}") from None


def request_fields(gen: GenerationConfig, stop_ids: Sequence[int]) -> dict[str, Any]:
    """The run's sampling keys as chat request fields (top_k, min_tokens and
    stop_token_ids are the server's extensions of OpenAI's)."""
    return {
        "max_tokens": gen.max_new_tokens,
        "min_tokens": gen.min_new_tokens,
        "temperature": gen.temperature,
        "top_p": gen.top_p,
        "top_k": gen.top_k,
        "stop_token_ids": [int(i) for i in stop_ids],
    }


def play(
    agent: EndpointAgent,
    server: ServerEngine,
    prompts: list[Text],
    columns: list[dict],
    gen: GenerationConfig,
    stop_ids: Sequence[int],
) -> list[Episode]:
    """One episode per prompt against `server` (generation/server.py ServerEngine, synced)
    -> the episodes as the in-process multi-turn rollout returns them."""
    return request(agent, server, prompts, columns, gen, stop_ids)()


def request(
    agent: EndpointAgent,
    server: ServerEngine,
    prompts: list[Text],
    columns: list[dict],
    gen: GenerationConfig,
    stop_ids: Sequence[int],
) -> Callable[[], list[Episode]]:
    """The episodes of `play`, named now (their ids drawn on this thread from the
    checkpointed RNG, so a resumed run names and seeds them as the unbroken one did) and
    played when the returned work runs (with ppo.max_staleness, on generation/prefetch.py's
    worker thread while the trainer trains). Their records must carry the servers' version
    when the work starts (with deferred syncs a sync queued before it runs first): nothing
    syncs while they play."""
    tag = f"{os.environ.get('RANK', '0')}-{int(sampling_seeds(1)[0])}"
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    urls = [server.urls[i % len(server.urls)] for i in range(len(prompts))]
    fields = request_fields(gen, stop_ids)

    def run(i: int) -> float | None:
        client = EndpointClient(
            f"{urls[i]}/v1", server.token, f"policy#{ids[i]}", fields, server.timeout_s,
            server.http,
        )  # fmt: skip
        kwargs = accepted_columns(agent.episode, columns[i], ("client", "prompt"))
        try:
            return agent.episode(client, prompts[i], **kwargs)
        except Exception as e:
            raise UserError(
                f"generation.environment: episode {i} raised {type(e).__name__}: {e}"
            ) from None

    def work() -> list[Episode]:
        version = server.version
        with ThreadPoolExecutor(max_workers=max(1, min(agent.at_once, len(prompts)))) as pool:
            rewards = list(pool.map(run, range(len(prompts))))
        return [
            _episode(record, reward, version, i)
            for i, (record, reward) in enumerate(zip(_collect(server, urls, ids), rewards))
        ]

    return work


def _collect(server: ServerEngine, urls: list[str], ids: list[str]) -> list[dict]:
    """Every episode's record, asked of the server that played it, in prompt order."""
    records: dict[str, dict] = {}
    for url in dict.fromkeys(urls):
        mine = [e for e, u in zip(ids, urls) if u == url]
        for e, record in zip(
            mine, server.call(url, "/v1/episodes", {"episodes": mine})["episodes"]
        ):
            records[e] = record
    return [records[e] for e in ids]


def _episode(record: dict | None, reward: float | None, version: int, i: int) -> Episode:
    """A collected record as an Episode (finished: the environment ended it)."""
    if record is None or not any(record["sampled"]):
        raise UserError(
            f"generation.environment: episode {i} made no chat request with the model "
            "name it was given (client.model)"
        )
    if record["versions"] != [version]:
        raise ServerError(
            f"rollout server: episode {i} was sampled with policy versions "
            f"{record['versions']}, the trainer synced version {version}"
        )
    messages = record["messages"]
    answers = [m for m in messages if m["role"] == "assistant"]
    pixels = record.get("pixels")  # a vision policy's images, in the order of their tokens
    try:
        media = [{k: tensor_of(v) for k, v in pixels.items()}] if pixels else []
    except ValueError as e:
        raise ServerError(f"rollout server: episode {i}'s pixel inputs: {e}") from None
    return Episode(
        env=None,
        messages=messages,
        prompt=record["prompt_ids"],
        tokens=record["token_ids"],
        sampled=record["sampled"],
        turns=len(answers),
        tool_calls=sum(m["role"] == "tool" for m in messages),
        done=True,
        finished=True,
        reward=None if reward is None else float(reward),
        answer=answers[-1]["content"],
        sampler_logprobs=record["logprobs"],
        media=media,
    )
