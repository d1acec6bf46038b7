"""The HTTP face of `rlhf-dist serve` (FastAPI; uvicorn runs it): docs/serving.md holds
the protocol.

GET /health (open): model, served policy version, whether a weight-sync group is
joined and the backends this server can join it with (`sync_backends`: gloo, and NCCL
where it has a GPU), the last failed update, the version of an update that stopped half-way
(`torn_update`, 0 when none: until the next whole update the sampling endpoints answer
503 rather than serve weights that are neither version), and with serve.batch_window_ms
the requests and generate calls so far (`batched`). Everything else needs `Authorization: Bearer <token>`
(serve.token_env), compared in constant time: POST /generate (token ids in, token ids
and log-probs out), /score (the post-sync check), /init_weight_sync and /update_weights
(the weight-sync protocol), and the OpenAI-compatible /v1/completions and
/v1/chat/completions. A malformed body is a 422 naming the field (pydantic), metadata
that does not fit the model a 400, a missing or wrong token a 401; none of them touches
the model, which keeps serving.
"""

from __future__ import annotations

import functools
import hmac
from collections.abc import Callable
from typing import Any, Literal, Protocol, TypeVar

from fastapi import Depends, FastAPI, Header, HTTPException
from pydantic import BaseModel, Field

from rlhf_dist.distributed.weight_sync import local_backends
from rlhf_dist.serving import openai_api as openai
from rlhf_dist.serving.batching import RequestBatcher
from rlhf_dist.serving.episodes import EpisodeLog
from rlhf_dist.serving.images import generate_media
from rlhf_dist.serving.policy import (
    BadRequest,
    SamplingRequest,
    ServedPolicy,
    TensorSpec,
    Unavailable,
)

TokenIds = list[int]
T = TypeVar("T")
# the token check every endpoint but /health depends on (FastAPI reads its Header)
Authorized = Callable[[str], None]


class Refusing(Protocol):
    """refused(call, *args): call(*args), with the policy's BadRequest answered as a 400
    and Unavailable as a 503."""

    def __call__(self, call: Callable[..., T], *args: Any) -> T: ...


class Sampling(BaseModel):
    max_new_tokens: int = Field(gt=0)
    min_new_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, gt=0)
    top_k: int = Field(0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int = Field(0, ge=0, lt=2**63)
    stop_token_ids: list[int] = []  # empty: the served model's own stop ids
    # a mixture-of-experts model's top-k expert indices of every token, per layer, beside
    # the tokens (ppo.routing_replay r3; docs/moe.md)
    routing: bool = False
    # a partial rollout (ppo.partial_rollouts): continues under updates that land while it
    # decodes; the answer has each token's policy version (serving/partial.py)
    partial: bool = False


class GenerateBody(BaseModel):
    prompts: list[TokenIds] = Field(min_length=1)
    sampling: Sampling
    # a vision-language model's images, one entry per prompt whose ids hold their image
    # tokens (serving/images.py): base64 image files, or the pixel inputs themselves
    images: list[list[str]] | None = None
    pixels: list[dict[str, dict] | None] | None = None


class ScoreBody(BaseModel):
    sequences: list[TokenIds] = Field(min_length=1)
    temperature: float = Field(1.0, gt=0)


class JoinBody(BaseModel):
    address: str = Field(min_length=1)
    port: int = Field(gt=0, lt=65536)
    rank: int = Field(gt=0)
    world_size: int = Field(gt=1)
    backend: str = "gloo"  # the trainer's pick of the /health `sync_backends`


class Spec(BaseModel):
    name: str = Field(min_length=1)
    shape: list[int]
    dtype: str
    lora: Literal["A", "B"] | None = None  # a LoRA matrix of weight `name` (policy.py)
    scale: float = Field(1.0, allow_inf_nan=False)


class EpisodesBody(BaseModel):
    episodes: list[str] = Field(min_length=1)


class UpdateBody(BaseModel):
    version: int = Field(gt=0)
    tensors: list[Spec] = Field(min_length=1)
    final: bool = False
    partial: bool = False  # staged, swapped in between decode steps (serving/partial.py)


def build_app(
    policy: ServedPolicy,
    token: str,
    max_batch: int,
    max_new_tokens: int,
    tool_call_parser: str = "hermes",
    batch_window_ms: float = 0.0,
) -> FastAPI:
    """The FastAPI app serving `policy`; `token` guards everything but /health; the
    serve.* keys: max_batch, max_new_tokens, tool_call_parser, batch_window_ms."""
    app = FastAPI(title="rlhf-dist serve", docs_url=None, redoc_url=None, openapi_url=None)
    # serve.batch_window_ms: concurrent requests sampled together; None: one at a time
    batcher = None
    if batch_window_ms > 0:
        batcher = RequestBatcher(policy, batch_window_ms / 1000, max_batch)

    def authorized(authorization: str = Header("")) -> None:
        scheme, _, given = authorization.partition(" ")
        if scheme != "Bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
            raise HTTPException(401, "missing or wrong token (Authorization: Bearer ...)")

    def refused(call: Callable[..., T], *args: Any) -> T:
        try:
            return call(*args)
        except BadRequest as e:
            raise HTTPException(400, str(e)) from None
        except Unavailable as e:
            raise HTTPException(503, str(e)) from None

    @app.get("/health")
    def health() -> dict:
        return _health(policy, batcher)

    _add_sampling(app, policy, authorized, refused, max_batch, max_new_tokens, batcher)
    _add_weight_sync(app, policy, authorized, refused)
    _add_openai(
        app, policy, authorized, refused, max_new_tokens, tool_call_parser == "hermes", batcher
    )
    return app


def _health(policy: ServedPolicy, batcher: RequestBatcher | None) -> dict:
    """/health's answer: the served model, its version and the weight-sync state; with
    serve.batch_window_ms how many requests each generate call took."""
    batched = (
        {}
        if batcher is None
        else {"batched": {"requests": batcher.requests, "batches": batcher.batches}}
    )
    return {
        "model": policy.name,
        "version": policy.version,
        "sync_group": policy.group is not None,
        "sync_backends": local_backends(),
        "last_error": policy.last_error,
        "torn_update": policy.torn,
    } | batched


def _add_sampling(
    app: FastAPI,
    policy: ServedPolicy,
    authorized: Authorized,
    refused: Refusing,
    max_batch: int,
    max_new_tokens: int,
    batcher: RequestBatcher | None,
) -> None:
    """/generate and /score: the trainer's token-in, token-out endpoints."""

    def batch(n: int, what: str) -> None:
        if n > max_batch:
            raise HTTPException(413, f"{what}: {n} rows, serve.max_batch is {max_batch}")

    @app.post("/generate", dependencies=[Depends(authorized)])
    def generate(body: GenerateBody) -> dict:
        batch(len(body.prompts), "prompts")
        s = body.sampling
        if s.max_new_tokens > max_new_tokens or s.min_new_tokens > s.max_new_tokens:
            raise HTTPException(
                400, f"sampling: need min_new_tokens <= max_new_tokens <= {max_new_tokens}"
            )
        sampling = SamplingRequest(**(s.model_dump() | {"stop_token_ids": tuple(s.stop_token_ids)}))
        media = refused(generate_media, policy, body.prompts, body.images, body.pixels)
        sampler = policy if batcher is None else batcher
        return refused(functools.partial(sampler.generate, media=media), body.prompts, sampling)

    @app.post("/score", dependencies=[Depends(authorized)])
    def score(body: ScoreBody) -> dict:
        batch(len(body.sequences), "sequences")
        return refused(policy.score, body.sequences, body.temperature)


def _add_weight_sync(
    app: FastAPI, policy: ServedPolicy, authorized: Authorized, refused: Refusing
) -> None:
    """/init_weight_sync and /update_weights: the trainer's side is generation/server.py."""

    @app.post("/init_weight_sync", dependencies=[Depends(authorized)])
    def init_weight_sync(body: JoinBody) -> dict:
        if body.rank >= body.world_size:
            raise HTTPException(400, f"rank: {body.rank} outside the world of {body.world_size}")
        refused(policy.join, body.address, body.port, body.rank, body.world_size, body.backend)
        return {"joining": True, "backend": body.backend}

    @app.post("/update_weights", dependencies=[Depends(authorized)])
    def update_weights(body: UpdateBody) -> dict:
        specs = [
            TensorSpec(t.name, tuple(t.shape), t.dtype, t.lora or "", t.scale) for t in body.tensors
        ]
        refused(policy.check_bucket, body.version, specs)
        policy.receive_bucket(body.version, specs, body.final, body.partial)
        return {"receiving": len(specs), "version": body.version}


def _add_openai(
    app: FastAPI,
    policy: ServedPolicy,
    authorized: Authorized,
    refused: Refusing,
    max_new: int,
    tool_calls: bool,
    batcher: RequestBatcher | None,
) -> None:
    """/v1/completions and /v1/chat/completions (serving/openai.py); a request without
    max_tokens gets serve.max_new_tokens; `tool_calls`: parse them (serve.tool_call_parser)."""

    def capped(body: openai.OpenAISampling) -> None:
        asked = body.max_completion_tokens or body.max_tokens or max_new
        if asked > max_new or body.min_tokens > asked:
            raise HTTPException(400, f"max_tokens: need min_tokens <= max_tokens <= {max_new}")

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    def completions(body: openai.CompletionBody) -> dict:
        capped(body)
        return refused(openai.completion, policy, body, max_new, batcher)

    episodes = None if policy.chat is None else EpisodeLog(policy.chat, policy.vision)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    def chat_completions(body: openai.ChatBody) -> dict:
        capped(body)
        return refused(openai.chat_completion, policy, body, max_new, episodes, tool_calls, batcher)

    @app.post("/v1/episodes", dependencies=[Depends(authorized)])
    def collect_episodes(body: EpisodesBody) -> dict:
        """The records of finished episodes (serving/episodes.py), removed from the log."""
        return {"episodes": [] if episodes is None else episodes.collect(body.episodes)}
