"""Rollouts from `rlhf-dist serve` processes (generation.backend=server; docs/serving.md).

`ServerEngine` is a Sampler (generation/base.py) like the in-process vLLM engine
(generation/vllm.py), with the servers' policy versions. Before every rollout
trainer rank 0 sends the actor's weights to every server a bucket at a time (under ZeRO-3
each bucket gathered on its own by every rank, never the whole model; with LoRA only the
adapters, which each server folds into its frozen base): each bucket's (name, shape, dtype) list
and the new version over HTTP, then the tensors by broadcast in the weight-sync group
(distributed/weight_sync.py). Then the
post-sync check: every server scores fixed token sequences and the trainer compares
with its own log-probs; a mean gap above generation.server_sync_tolerance stops the run
(a sync that looked normal but left stale weights: trl#5312, verl#7495).

Each rank cuts its prompts into one contiguous shard per server (data-parallel servers)
and asks them concurrently, each shard with its own seed from torch's global RNG (so a
resumed run draws the same seeds). Every answer carries the policy version it was
sampled with; one that is not the version synced before the request is an error.
With ppo.max_staleness >= 1 (generation/prefetch.py) the requests run on a thread of their
own while the trainer trains. HTTP through rlhf_dist/http_client.py (httpx, pooled
connections); every call times out after distributed.timeout_s.
"""

from __future__ import annotations

import base64
import binascii
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch

from rlhf_dist.checkpoint import fault_active, maybe_fault
from rlhf_dist.config import Config, GenerationConfig
from rlhf_dist.data.vision import Media, RowMedia
from rlhf_dist.distributed.weight_sync import (
    MemoryGrowth,
    SyncGroup,
    dtype_name,
    free_port,
    sync_backend,
    weight_buckets,
    whole_bucket,
)
from rlhf_dist.distributed.zero3 import whole_shape
from rlhf_dist.engine.forward import token_logprobs
from rlhf_dist.engine.sampling import Sampling
from rlhf_dist.errors import ConfigError, ServerError, UserError
from rlhf_dist.generation.base import (
    GenerationContext,
    Prompts,
    Samples,
    Seeds,
    StopIds,
)
from rlhf_dist.generation.vllm import checkpoint_parameters, prompts_for_engine, sampling_seeds
from rlhf_dist.http_client import HTTPFailure, JSONClient
from rlhf_dist.models.lora import adapter_weights

if TYPE_CHECKING:
    from rlhf_dist.distributed import Runtime

T = TypeVar("T")
CHECK_ROWS, CHECK_TOKENS = 2, 16  # the post-sync check's fixed sequences


def sync_entries(
    actor: torch.nn.Module, with_base: bool
) -> list[tuple[tuple[str, str, float], torch.Tensor]]:
    """What a sync sends, as ((weight name, LoRA role, scale), tensor): every weight whole
    (role ""); with LoRA adapters only their A and B matrices (role "A" / "B": each server
    folds scale * B @ A into its own copy of the frozen base, megabytes instead of the
    model), after the frozen base itself where `with_base` (the first sync of this trainer
    with a server: what it served before may be another run's weights)."""
    adapters = [((name, role, scale), t) for name, role, t, scale in adapter_weights(actor)]
    if adapters and not with_base:
        return adapters
    return [((name, "", 1.0), p) for name, p in checkpoint_parameters(actor)] + adapters


class ServerEngine:
    """The trainer's side of one or more rollout servers (a Sampler)."""

    from_actor = False
    in_step = True  # the ranks agree on every answer's failure (`together`)
    # ppo.partial_rollouts: updates land on the servers while they generate (staged and
    # swapped in between decode steps, serving/partial.py); answers carry per-token versions
    partial = False
    checked_version = 0  # the version of the last sync that passed its check

    def __init__(
        self, cfg: Config, is_main: bool, all_max: Callable[[torch.Tensor], torch.Tensor],
        weights: GenerationContext | None = None,
    ) -> None:  # fmt: skip
        """is_main: this is trainer rank 0 (it syncs the weights); all_max(x): the elementwise
        maximum of x over the trainer ranks (Runtime.all_max; a collective, every rank
        calls it); weights: () -> context yielding (actor, _) whose weights `sync` sends
        (under ZeRO-3 partitioned: gathered a bucket at a time; None: load_weights only)."""
        self.weights = weights
        g = cfg.generation
        self.urls = [u.rstrip("/") for u in g.server_urls]
        self.timeout_s = float(cfg.distributed.timeout_s)
        self._token = os.environ.get(g.server_token_env, "") if g.server_token_env else ""
        if not self._token:
            raise ConfigError(
                f"generation.server_token_env: set the environment variable "
                f"{g.server_token_env or '(none named)'} to the servers' shared token"
            )
        self.bucket_bytes = int(g.server_sync_bucket_mb * 2**20)
        self.tolerance, self.address = g.server_sync_tolerance, g.server_sync_address
        # one pool of connections for every call of this run (rlhf_dist/http_client.py),
        # room for all at once: the endpoint's episodes, and a shard per server of each
        # rollout in flight (ppo.max_staleness ahead of the one being used)
        in_flight = g.endpoint_episodes_at_once + (1 + cfg.ppo.max_staleness) * len(self.urls)
        self.http = JSONClient(self.timeout_s, max_connections=max(16, in_flight))
        self._auth = {"Authorization": f"Bearer {self._token}"}
        self.is_main, self.all_max = is_main, all_max
        self.group: SyncGroup | None = None
        self.version = 0  # the policy version every server holds after the last sync
        self.syncs = 0  # weight syncs of this run (RLHF_DIST_FAULT=skip_weight_sync:N)
        self.check_ids = torch.zeros(0, dtype=torch.long)  # the post-sync check's sequences
        self.sync_gap = 0.0  # rank 0: the last post-sync check's largest gap over the servers
        self.sync_seconds = 0.0  # the last sync, check included
        self.sync_peak_bytes = 0  # the last sync's memory growth on this rank (sampled)
        self.joined = False  # rank 0: the servers joined a new sync group (send the base)
        # ppo.routing_replay r3: the servers return their MoE routing beside the tokens
        self.routing = cfg.ppo.routing_replay == "r3"
        self.partial = cfg.ppo.partial_rollouts

    @property
    def token(self) -> str:
        """The shared token (for the episodes of generation.environment_endpoint)."""
        return self._token

    def call(self, url: str, path: str, body: dict | None = None) -> dict:
        """One HTTP call (GET without a body) -> its JSON answer; ServerError otherwise."""
        try:
            return cast(dict, self.http.call(url + path, body, self._auth))
        except HTTPFailure as e:
            within = "" if e.status else f" (within {self.timeout_s:g} s)"
            raise ServerError(f"rollout server {url}{path}: {e}{within}") from None

    def any_rank(self, flag: bool) -> bool:
        """Whether any trainer rank passed True (a collective)."""
        return bool(self.all_max(torch.tensor(float(flag))) > 0)

    def together(
        self, work: Callable[[], T], errors: tuple[type[Exception], ...] = (ServerError,)
    ) -> T:
        """work()'s result; when it raised one of `errors` on any trainer rank, that error
        there and ServerError on every other rank, at once (so they stop, and checkpoint,
        together; no rank is left waiting in a collective)."""
        error: Exception | None = None
        result = None
        try:
            result = work()
        except errors as e:
            error = e
        if self.any_rank(error is not None):
            raise error or ServerError("rollout server: another trainer rank's call failed")
        return cast(T, result)

    def load_weights(self, actor: torch.nn.Module) -> None:
        """Send `actor`'s weights to every server as a new version and check them. Every
        trainer rank calls it together: under ZeRO-3 or FSDP2 each bucket is gathered by all of
        them (`whole_bucket`; the actor may stay sharded), and rank 0 sends it."""
        self.syncs += 1
        start = time.perf_counter()
        device = next(actor.parameters()).device
        self.together(lambda: self._begin(device) if self.is_main else None)
        # rank 0 knows whether a server joined anew (it may hold another run's weights)
        with_base = self.any_rank(self.joined)
        with MemoryGrowth(device) as grown:
            self.together(lambda: self._send(actor, with_base))
        self.sync_peak_bytes, self.joined = grown.peak_bytes, False
        ours = self._own_logprobs(actor)  # every rank: under ZeRO-3 a collective forward
        self.together(lambda: self._check(ours) if self.is_main else None)
        # Rank 0's version, by a collective: a server's /health may still show the old one
        # while it applies the last bucket, and a request stamped with that would be refused.
        self.version = int(self.all_max(torch.tensor(self.version if self.is_main else 0)))
        self.checked_version = self.version
        self.sync_seconds = time.perf_counter() - start

    def _begin(self, device: torch.device) -> None:
        """Rank 0: make the weight-sync group (first sync, or again when a server holds
        none: it restarted) and pick the new version, one above the last synced and any
        server's: a restarted server (version 0) rejoins at the version the others move
        to, and versions never go back (a rollout's version orders it). The
        group's backend: NCCL where the actor (on `device`) and every server are on CUDA
        (`sync_backend`), else gloo."""
        healths = [self.call(url, "/health") for url in self.urls]
        backend = sync_backend(device, [h.get("sync_backends", ["gloo"]) for h in healths])
        fresh = self.group is None or self.group.backend != backend
        if fresh or not all(h["sync_group"] for h in healths):
            self._join(backend)
            self.joined = True
        self.version = 1 + max([self.version] + [h["version"] for h in healths])

    def _send(self, actor: torch.nn.Module, with_base: bool) -> None:
        """Walk the weights (`sync_entries`) a bucket at a time on every rank; rank 0
        announces and broadcasts each. After a failure rank 0 stops sending but keeps
        walking (the other ranks are in the buckets' gathers), then raises."""
        buckets = list(weight_buckets(sync_entries(actor, with_base), self.bucket_bytes))
        # RLHF_DIST_FAULT=skip_weight_sync:N (tests): the servers keep their old weights.
        sending = self.is_main and not fault_active("skip_weight_sync", self.syncs)
        error = None
        for i, bucket in enumerate(buckets):
            with whole_bucket([p for _, p in bucket]) as whole:
                if sending and error is None:
                    try:
                        keys = [key for key, _ in bucket]
                        self._send_bucket(list(zip(keys, whole)), final=i == len(buckets) - 1)
                    except ServerError as e:
                        error = e
                    # RLHF_DIST_FAULT=weight_sync:N (tests): SIGKILLed after the first bucket
                    # of sync N, the servers hold a torn update (serving/policy.py)
                    maybe_fault("weight_sync", self.syncs)
        if error is not None:
            raise error

    def _send_bucket(self, bucket: list, final: bool) -> None:
        """One bucket of whole weights (or adapter matrices): metadata to every server,
        then the broadcasts."""
        assert self.group is not None
        tensors = [self.group.placed(p) for _, p in bucket]  # CPU (gloo) or its GPU (NCCL)
        specs = [
            {"name": name, "shape": list(t.shape), "dtype": dtype_name(t.dtype)}
            | ({"lora": role, "scale": scale} if role else {})
            for ((name, role, scale), _), t in zip(bucket, tensors)
        ]
        body = {"version": self.version, "tensors": specs, "final": final}
        if self.partial:
            body["partial"] = True
        for url in self.urls:
            self.call(url, "/update_weights", body)
        try:
            for t in tensors:
                self.group.broadcast(t)
        except RuntimeError as e:  # a timeout or a peer gone (torch's DistError)
            self.group = None  # unusable now: the next sync makes a new one
            why = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ServerError(f"weight broadcast to the rollout servers failed: {why}") from None

    def _join(self, backend: str) -> None:
        """Make the weight-sync group over `backend`: rank 0 here, server i rank i + 1."""
        port, world = free_port(self.address), 1 + len(self.urls)
        for i, url in enumerate(self.urls):
            body = {"address": self.address, "port": port, "rank": i + 1, "world_size": world}
            self.call(url, "/init_weight_sync", body | {"backend": backend})
        try:
            self.group = SyncGroup(self.address, port, 0, world, self.timeout_s, backend)
        except RuntimeError as e:  # a server that never joined: torch's store timeout
            why = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ServerError(f"weight-sync group with the rollout servers: {why}") from None

    @torch.no_grad()
    def _own_logprobs(self, actor: torch.nn.Module) -> torch.Tensor:
        """The actor's log-probs (CHECK_ROWS, CHECK_TOKENS - 1) at temperature 1, on CPU,
        of the check's fixed sequences (`check_ids`: uniform token ids, seed 0)."""
        weight = actor.get_input_embeddings().weight
        vocab = int(whole_shape(weight)[0])  # ZeRO-3: the whole shape
        g = torch.Generator().manual_seed(0)  # the same sequences every sync
        self.check_ids = torch.randint(0, vocab, (CHECK_ROWS, CHECK_TOKENS), generator=g)
        seqs = self.check_ids.to(weight.device)
        predict = torch.ones(CHECK_ROWS, CHECK_TOKENS - 1, dtype=torch.bool, device=weight.device)
        ours, _ = token_logprobs(actor, seqs, torch.ones_like(seqs), predict, 1.0)
        return ours.float().cpu()

    def _check(self, ours: torch.Tensor) -> None:
        """The post-sync check: the servers' log-probs of the fixed sequences against the
        actor's (`ours`); ServerError when the mean gap exceeds the tolerance."""
        seqs, self.sync_gap = self.check_ids.tolist(), 0.0
        for url in self.urls:
            answer = self.call(url, "/score", {"sequences": seqs, "temperature": 1.0})
            theirs = torch.tensor(answer["logprobs"], dtype=torch.float32)
            gap = float((ours - theirs).abs().mean())
            self.sync_gap = max(self.sync_gap, gap)
            if not gap <= self.tolerance:
                raise ServerError(
                    f"post-sync check: {url} scores fixed sequences {gap:.3g} nats per token away "
                    f"from the trainer after weight version {self.version} "
                    f"(generation.server_sync_tolerance {self.tolerance:g}): it does not hold the "
                    "trained weights"
                )

    def generate(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, gen_cfg: Sampling,
        stop_ids: StopIds, pad_id: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Sample one response per left-padded prompt (B, P) on the servers -> (response_ids
        (B, T) PAD after each response, sampler_logprobs (B, T) float32, 0 on padding)."""
        ids, logprobs, _ = self.generate_routed(prompt_ids, prompt_mask, gen_cfg, stop_ids, pad_id)
        return ids, logprobs

    def generate_routed(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, gen_cfg: Sampling,
        stop_ids: StopIds, pad_id: int, media: RowMedia | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """`generate`, and with ppo.routing_replay=r3 the servers' routing (B, P + T, L, k)
        in the trainer's layout (`routing_of`; None otherwise); `media`: each row's pixel
        inputs, sent beside its prompt (`pixel_specs`)."""
        ask = self.request(prompt_ids, prompt_mask, gen_cfg, stop_ids, media)
        version = self.version

        def answered() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
            answers = ask()
            ids, lp = self.responses(answers, version, pad_id, prompt_ids.device)
            routed = routing_of(answers, prompt_mask, ids.shape[1]) if self.routing else None
            return ids, lp, routed

        # on every rank together: a failed call or a wrong version stops them all at once
        return self.together(answered)

    def request(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, gen_cfg: Sampling,
        stop_ids: StopIds, media: RowMedia | None = None,
        generator: torch.Generator | None = None,
    ) -> Callable[[], list[tuple[str, dict]]]:  # fmt: skip
        """The HTTP work of one rollout, not yet done: a callable that asks every server
        for its shard concurrently and returns [(url, answer)], raising ServerError. Only
        HTTP, no collective: it may run on another thread (ppo.max_staleness, prefetch.py).
        The shards' seeds are drawn here, on the calling thread, from torch's global RNG,
        or from `generator` (a multi-turn episode's turns on a worker thread: their own
        stream, whatever the main thread draws meanwhile). A row's images travel as its
        pixel inputs (`pixel_specs`) when any row has some."""
        rows = [r["prompt_token_ids"] for r in prompts_for_engine(prompt_ids, prompt_mask)]
        pixels = None
        if media is not None and media.joined() is not None:
            pixels = [pixel_specs(m) for m in media.rows]
        bounds = torch.linspace(0, len(rows), len(self.urls) + 1).round().long().tolist()
        shards = [(u, a, b) for u, a, b in zip(self.urls, bounds, bounds[1:]) if b > a]
        seeds = sampling_seeds(len(shards), generator=generator).tolist()
        sampling = {
            "max_new_tokens": gen_cfg.max_new_tokens, "min_new_tokens": gen_cfg.min_new_tokens,
            "temperature": gen_cfg.temperature, "top_k": gen_cfg.top_k, "top_p": gen_cfg.top_p,
            "stop_token_ids": [int(i) for i in stop_ids],
        } | ({"routing": True} if self.routing else {})  # fmt: skip
        if self.partial:
            sampling["partial"] = True

        def ask(i: int) -> tuple[str, dict]:
            url, a, b = shards[i]
            body = {"prompts": rows[a:b], "sampling": {**sampling, "seed": seeds[i]}}
            if pixels is not None:
                body["pixels"] = pixels[a:b]
            return url, self.call(url, "/generate", body)

        def ask_all() -> list[tuple[str, dict]]:
            with ThreadPoolExecutor(max_workers=len(shards)) as pool:
                return list(pool.map(ask, range(len(shards))))

        return ask_all

    def responses(
        self, answers: list, version: int, pad_id: int, device: torch.device | str | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The servers' answers [(url, answer)] of one rollout -> (response_ids (B, T),
        sampler_logprobs (B, T)) as `generate` returns them; ServerError when a server
        sampled with another policy version than `version`, the one synced before the
        request (call it inside `together`)."""
        responses, logprobs = [], []
        for url, answer in answers:
            if self.partial:
                _check_partial(url, answer, version)
            elif answer["version"] != version:
                raise ServerError(
                    f"rollout server {url}: sampled with policy version "
                    f"{answer['version']}, the trainer synced version {version}"
                )
            responses += answer["responses"]
            logprobs += answer["logprobs"]
        return _padded(responses, logprobs, pad_id, device)

    def sleep(self) -> None:
        """Nothing to free in this process: the engine lives in the servers."""

    def sync(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, gen: GenerationConfig,
        stop_ids: StopIds, tokenizer: Any,
    ) -> None:  # fmt: skip
        """`load_weights` of the actor inside `weights` (a bucket at a time)."""
        assert self.weights is not None, "ServerEngine.sync without the actor's weights"
        with self.weights() as (actor, _):
            self.load_weights(actor)

    def sample(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, gen: Sampling,
        stop_ids: StopIds, pad_id: int, rows_per_pass: int | None = None,
        seeds: Seeds | None = None, logprobs: bool = False, media: RowMedia | None = None,
    ) -> Samples:  # fmt: skip
        """`generate` (every rank together), each row stamped with the synced version; the
        servers' log-probs always come with the tokens. No `seeds`: the shards' seeds are
        drawn from the global RNG (`request`)."""
        _no_seeds(seeds)
        version = self.version
        ids, lp, routed = self.generate_routed(
            prompt_ids, prompt_mask, gen, stop_ids, pad_id, media
        )
        return Samples(ids, lp, _versions(ids, version), routed)

    def expect_next(self, iteration: int, upcoming: Prompts | None) -> None:
        """Nothing: it samples on-policy (ppo.max_staleness: prefetch.py)."""

    def stats(self, runtime: Runtime) -> dict[str, float]:
        """The last post-sync check's mean per-token log-prob gap (the largest over the
        servers), the policy version the rollout was sampled with, the sync's seconds and
        its memory growth on the rank that grew most (sampled: GPU tensor memory, else the
        resident set; the gathered buckets and rank 0's host copies of one). A collective."""
        gap = float(runtime.all_max(torch.tensor(self.sync_gap)))
        grown = float(runtime.all_max(torch.tensor(float(self.sync_peak_bytes)))) / 2**20
        return {
            "rollout/server_sync_gap": gap,
            "memory/sync_peak_mib": grown,
            "rollout/policy_version": float(self.version),
            "time/weight_sync": self.sync_seconds,
        }

    def servers(self) -> ServerEngine | None:
        return self

    def episodes(self, prompts: Prompts, play: Callable[[Any], Callable[[], list]]) -> list:
        """The episodes played now by the synced weights; an environment's error or a
        server's on one rank stops every rank at once."""
        return self.together(play(prompts), errors=(ServerError, UserError))

    def close(self) -> None:
        """Nothing in flight: every request is awaited where it is made."""


# dtype names a pixel input travels as (float and half models' pixels, long grids and ids)
PIXEL_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
}


def tensor_spec(t: torch.Tensor) -> dict:
    """{"dtype", "shape", "data": base64 of its bytes in C order} of `t` (`tensor_of`)."""
    name = next((k for k, v in PIXEL_DTYPES.items() if v == t.dtype), None)
    if name is None:
        raise ValueError(f"a pixel input of dtype {t.dtype} cannot travel to a server")
    flat = t.detach().cpu().contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return {"dtype": name, "shape": list(t.shape), "data": base64.b64encode(raw).decode()}


def tensor_of(spec: dict) -> torch.Tensor:
    """The tensor `tensor_spec` wrote; ValueError (one line) for a malformed one."""
    dtype = PIXEL_DTYPES.get(str(spec.get("dtype")))
    shape = spec.get("shape")
    if dtype is None:
        raise ValueError(f"dtype {spec.get('dtype')!r} not in {sorted(PIXEL_DTYPES)}")
    if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise ValueError("shape must be a list of sizes")
    try:
        raw = bytearray(base64.b64decode(str(spec.get("data", "")), validate=True))
    except (binascii.Error, ValueError):
        raise ValueError("data not base64") from None
    size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if len(raw) != size:
        raise ValueError(f"{len(raw)} bytes for shape {shape} of {spec['dtype']}")
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(raw, dtype=dtype).reshape(shape).clone()


def pixel_specs(media: Media | None) -> dict[str, dict] | None:
    """One row's pixel inputs (data/vision.py Media) as /generate's `pixels` entry: each
    by its processor name (None: a row without images)."""
    return None if not media else {k: tensor_spec(v) for k, v in media.items()}


def _no_seeds(seeds: Seeds | None) -> None:
    """The servers' client draws its shards' seeds itself: `seeds` must be None."""
    if seeds is not None:
        raise ValueError("seeds: the rollout servers' client draws each shard's seed itself")


def routing_of(answers: list, prompt_mask: torch.Tensor, T: int) -> torch.Tensor:
    """The servers' routing of one rollout (each answer's "routing": per row, the [L][k]
    expert indices of its real prompt tokens then its response tokens) in the trainer's
    layout (B, P + T, L, k), prompt_mask (B, P) left-padded: -1 on padding and past what a
    server routed (a response's last token). ServerError for a server that sent none."""
    rows = []
    for url, answer in answers:
        if "routing" not in answer:
            raise ServerError(
                f"rollout server {url}: no routing in its answer (ppo.routing_replay=r3 "
                "needs a mixture-of-experts model served by the decode loop)"
            )
        rows += answer["routing"]
    lengths = prompt_mask.sum(1).tolist()
    L, k = _routing_dims(rows)
    P = prompt_mask.shape[1]
    out = torch.full((len(rows), P + T, L, k), -1, dtype=torch.long)
    for b, (row, p) in enumerate(zip(rows, lengths)):
        if row:
            got = torch.tensor(row, dtype=torch.long)[: p + T]  # (p + n, L, k)
            out[b, P - p : P - p + got.shape[0]] = got
    return out.to(prompt_mask.device)


def _routing_dims(rows: list) -> tuple[int, int]:
    """(L, k) of the first non-empty routed row (each token's [L][k] indices)."""
    for row in rows:
        if row:
            return len(row[0]), len(row[0][0])
    raise ServerError("rollout server: an empty routing for every row")


def _check_partial(url: str, answer: dict, version: int) -> None:
    """A partial rollout's answer: every token sampled by `version` (the last sync checked
    before the request) or a later one, a row's versions never going back; ServerError."""
    for row in answer.get("versions", [[-1]]):
        if row and (row[0] < version or any(b < a for a, b in zip(row, row[1:]))):
            raise ServerError(
                f"rollout server {url}: a partial rollout's token versions {row} are not "
                f"non-decreasing from the synced version {version}"
            )


def token_versions(answers: list, device: torch.device | str | None) -> torch.Tensor:
    """(B, T) int64: the policy version of each response token of partial rollouts'
    answers [(url, answer)], -1 on padding (T >= 1, as `_padded`)."""
    rows = [r for _, answer in answers for r in answer["versions"]]
    out = torch.full((len(rows), max(1, max(len(r) for r in rows))), -1, dtype=torch.long)
    for b, r in enumerate(rows):
        out[b, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out.to(device)


def _versions(ids: torch.Tensor, version: int) -> torch.Tensor:
    """(B,) int64: `version` for each of the B rows of `ids` (B, T)."""
    return torch.full((ids.shape[0],), version, dtype=torch.long, device=ids.device)


def _padded(
    responses: list[list[int]], logprobs: list[list[float]], pad_id: int,
    device: torch.device | str | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Right-padded (B, T) ids (pad_id) and float32 log-probs (0), T >= 1."""
    T = max(1, max(len(r) for r in responses))
    ids = torch.full((len(responses), T), pad_id, dtype=torch.long)
    lp = torch.zeros(len(responses), T, dtype=torch.float32)
    for b, (r, p) in enumerate(zip(responses, logprobs)):
        ids[b, : len(r)] = torch.tensor(r, dtype=torch.long)
        lp[b, : len(p)] = torch.tensor(p, dtype=torch.float32)
    return ids.to(device), lp.to(device)


def wait_healthy(url: str, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> bool:
    """Poll `url`/health until it answers (True), or until `alive()` turns False (the
    server process ended) or `timeout_s` passed (False): starting a server loads a model."""
    deadline, http = time.monotonic() + timeout_s, JSONClient(5.0, max_connections=1)
    try:
        while alive() and time.monotonic() < deadline:
            try:
                http.call(url + "/health")
                return True
            except HTTPFailure:
                time.sleep(0.3)
        return False
    finally:
        http.close()
