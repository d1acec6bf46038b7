"""The served policy: the model behind `rlhf-dist serve`, what its endpoints call.

Generation goes through one Sampler (generation/base.py), the trainer's own: `sample`
with each request's seed for its rows (`seeds`) and the sampler's log-probs (`logprobs`).
By default the sampler is the hf decode loop the trainer runs in-process (generation/hf.py
HFSampler over the served model), so a served rollout is the in-process one: same seed,
same left-padded prompts, same tokens. Its log-probs are the trainer's own sequence
forward (engine/forward.py token_logprobs) over the sampled tokens at the sampling
temperature: log softmax(logits / T) of the full vocabulary, the distribution the hf
sampler draws from when top_k and top_p are off (with them on, the untruncated one; EOS
suppression by min_new_tokens is not reflected).

With `serve.engine=vllm` the sampler is a vLLM engine (`engine`, generation/vllm.py
VLLMEngine: per-row seeds drawn from the request's seed, the log-probs vLLM sampled with,
after temperature and top-k / top-p). It also scores (its prompt log-probs, so the
post-sync check reads the engine's own weights: scoring is no Sampler's work, so `_score`
still picks the engine or the model's forward). The model then stays on the CPU as the
staging copy an update's buckets land in; the engine reloads from it when the update's
last bucket is in, and resets its prefix cache (KV blocks of the old weights).

One model, one lock: requests run one at a time. A weight update arrives as buckets,
each announced over HTTP (`check_bucket`) and then broadcast from trainer rank 0
(`receive_bucket`, on a single worker thread, in order); requests wait for the updates
announced before them. The version moves when the last bucket of an update is in. The
decode loop keeps no cache between requests (each KV cache lives for one call), so
nothing is left to reset after an update. An update sent for partial rollouts
(ppo.partial_rollouts) is staged instead and swapped in whole between decode steps, the
running request's KV cache recomputed (serving/partial.py).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from rlhf_dist.checkpoint import fault_active
from rlhf_dist.config import PerfConfig
from rlhf_dist.data.chat import Chat
from rlhf_dist.data.rows import left_pad, right_pad
from rlhf_dist.data.vision import Media, RowMedia, VisionInputs
from rlhf_dist.distributed.weight_sync import DTYPES, SyncGroup, local_backends
from rlhf_dist.engine.decode import truncate_after_eos
from rlhf_dist.engine.forward import token_logprobs
from rlhf_dist.generation.base import Sampler
from rlhf_dist.generation.hf import HFSampler
from rlhf_dist.generation.vllm import VLLMEngine
from rlhf_dist.models.routing import is_moe
from rlhf_dist.serving.partial import PartialDecode, Staging, decode_partial

# each prompt's pixel inputs (data/vision.py Media; None: no images), or None for none
PromptMedia = list[Media | None] | None


@dataclass(frozen=True)
class SamplingRequest:
    """One request's sampling keys (engine/sampling.py Sampling) and its seed."""

    max_new_tokens: int
    min_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop_token_ids: tuple[int, ...] = ()  # empty: the served model's own (model.policy)
    routing: bool = False  # answer with the routing (ppo.routing_replay r3, docs/moe.md)
    # a partial rollout (ppo.partial_rollouts, serving/partial.py): updates that land while
    # it decodes are swapped in between its steps; the answer has per-token versions
    partial: bool = False


@dataclass(frozen=True)
class TensorSpec:
    """One weight of an update bucket: its parameter name, shape and dtype name; or, with
    `lora` "A" / "B", one LoRA matrix of that weight and the adapter's scale."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    lora: str = ""
    scale: float = 1.0


def _check_adapter(spec: TensorSpec, weight: tuple[int, ...]) -> None:
    """A LoRA matrix must fit its weight: a 2-D (out, in) weight's A (r, in) and B (out, r);
    a mixture of experts' fused 3-D (E, out, in) weight's A (r E, in) and B (out, r E)
    (peft's target_parameters, models/lora.py)."""
    shape = spec.shape
    fits = (
        len(weight) in (2, 3)
        and len(shape) == 2
        and (shape[1] == weight[-1] if spec.lora == "A" else shape[0] == weight[-2])
        and (len(weight) == 2 or shape[0 if spec.lora == "A" else 1] % weight[0] == 0)
    )
    if not fits:
        raise BadRequest(
            f"tensors: LoRA {spec.lora} of {spec.name} has shape {list(shape)}, which does "
            f"not fit the weight's {list(weight)} (A: (r, in), B: (out, r); experts' "
            "(E, out, in): A (r E, in), B (out, r E))"
        )


def routing_rows(routing: torch.Tensor, mask: torch.Tensor, lengths: list[int]) -> list:
    """Each row's routing as /generate answers it: the [L][k] expert indices of its real
    prompt tokens, then of its first lengths[b] response tokens. routing: (B, P + T, L, k);
    mask: (B, P) the left-padded prompts' attention mask."""
    P = mask.shape[1]
    response = torch.arange(routing.shape[1] - P)
    keep = [torch.cat([m.bool(), response < k]) for m, k in zip(mask, lengths)]
    return [r[kept].tolist() for r, kept in zip(routing, keep)]


def lora_delta(a: torch.Tensor, b: torch.Tensor, experts: int) -> torch.Tensor:
    """B @ A of a 2-D weight (experts 0); of a fused (E, out, in) experts weight, expert
    e's B_e @ A_e with A (r E, in) rows e r .. e r + r - 1 and B (out, r E) columns
    e, E + e, ... (peft ParamWrapper's layout, its get_delta_weight): (E, out, in)."""
    if not experts:
        return b @ a
    a3 = a.reshape(experts, -1, a.shape[-1])  # (E, r, in)
    b3 = b.reshape(b.shape[0], -1, experts).permute(2, 0, 1)  # (E, out, r)
    return b3 @ a3


class BadRequest(ValueError):
    """A request the server refuses (its message is the 4xx answer's detail)."""


class Unavailable(RuntimeError):
    """The server cannot answer now: its weights are half-way through an update that
    stopped (a 503; the next whole update serves again)."""


class ServedPolicy:
    def __init__(
        self, model: torch.nn.Module, tokenizer: Any, stop_ids: Iterable[int], perf: PerfConfig,
        name: str, timeout_s: float, chat: Chat | None = None, engine: VLLMEngine | None = None,
        vision: VisionInputs | None = None,
    ):  # fmt: skip
        """chat: how the OpenAI-compatible chat endpoint renders messages (None: it refuses);
        engine: a VLLMEngine that samples and scores (None: the decode loop on `model`);
        vision: a vision-language model's processor inputs (None: a text model; images
        are refused)."""
        self.model, self.tokenizer, self.stop_ids = model.eval(), tokenizer, tuple(stop_ids)
        self.chat, self.engine, self.vision = chat, engine, vision
        # what generates: the engine, or the trainer's decode loop over the served model
        self.sampler: Sampler = engine or HFSampler(self._served, perf)
        # a mixture-of-experts model through the decode loop: requests may ask for the
        # routing of every token (ppo.routing_replay r3); None: such a request is refused
        routed = engine is None and is_moe(model)
        self.routed: Sampler | None = HFSampler(self._served, perf, True) if routed else None
        self.perf, self.name, self.timeout_s = perf, name, timeout_s
        self.vocab = int(model.get_input_embeddings().weight.shape[0])
        self.device = next(model.parameters()).device
        self.params = dict(model.named_parameters())
        self.version = 0
        self.lock = threading.Lock()
        self.group: SyncGroup | None = None
        self.updates = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-sync")
        # Every forward runs on this one thread, whichever request thread asked (they run
        # one at a time under the lock anyway): the allocator then keeps freed memory for
        # one thread. Run on the web server's many request threads, each decode's KV cache,
        # logits and packed weights were kept per thread by glibc's arenas: SmolLM2-135M's
        # server grew to 18 GiB over 96 concurrent chat requests (docs/serving.md).
        self.model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self.pending: list[Future] = []
        self.pending_lock = threading.Lock()  # request threads add and prune `pending`
        self.last_error = ""  # the last failed update, for /health
        # the version whose update stopped after some of its buckets were written (0: none):
        # those weights are neither the old version nor the new, and are never served
        self.torn = 0
        # LoRA updates (`_apply`): each adapted weight's frozen base, and matrices waiting
        # for their pair (A and B of one weight may travel in two buckets)
        self.bases: dict[str, torch.Tensor] = {}
        self.adapter_parts: dict[str, dict[str, torch.Tensor]] = {}
        self.staging = Staging()  # partial updates (serving/partial.py), swapped in whole

    def checked_stops(self, prompts: list[list[int]], s: SamplingRequest) -> tuple[int, ...]:
        """The stop ids a request samples with, once its prompts and stop ids are checked
        (BadRequest)."""
        self.check_ids(prompts, "prompts")
        stops = s.stop_token_ids or self.stop_ids
        self.check_ids([list(stops)], "stop_token_ids")
        return stops

    def check_ids(self, seqs: list[list[int]], what: str) -> None:
        for i, seq in enumerate(seqs):
            if not seq:
                raise BadRequest(f"{what}[{i}]: empty")
            bad = [t for t in seq if not 0 <= t < self.vocab]
            if bad:
                raise BadRequest(f"{what}[{i}]: token id {bad[0]} outside [0, {self.vocab})")

    def generate(
        self, prompts: list[list[int]], s: SamplingRequest,
        seeds: list[tuple[int, int]] | None = None, media: PromptMedia = None,
    ) -> dict:  # fmt: skip
        """_generate's answer, computed on the model thread."""
        return self.model_thread.submit(self._generate, prompts, s, seeds, media).result()

    def row_media(self, prompts: list[list[int]], media: PromptMedia) -> RowMedia | None:
        """The sampler's `media` of prompts and their pixel inputs (None per prompt without
        images); BadRequest for images this server cannot sample (a text model, vLLM) and
        for a prompt that holds image tokens without pixel inputs."""
        if self.vision is None:
            if media is not None and any(m for m in media):
                raise BadRequest("images: the served model is not a vision-language model")
            return None
        token = self.vision.image_token_id
        media = media or [None] * len(prompts)
        if len(media) != len(prompts):
            raise BadRequest(f"images: {len(media)} entries for {len(prompts)} prompts")
        for i, (ids, m) in enumerate(zip(prompts, media)):
            if token in ids and not m:
                raise BadRequest(f"prompts[{i}]: image tokens without images")
        if self.engine is not None and any(m for m in media):
            raise BadRequest("images: sampled by the decode loop only (serve.engine=hf)")
        rows = tuple({k: v.to(self.device) for k, v in m.items()} if m else None for m in media)
        return RowMedia(rows, token)

    def score(self, sequences: list[list[int]], temperature: float) -> dict:
        """_score's answer, computed on the model thread."""
        return self.model_thread.submit(self._score, sequences, temperature).result()

    @torch.no_grad()
    def _generate(
        self, prompts: list[list[int]], s: SamplingRequest,
        seeds: list[tuple[int, int]] | None = None, media: PromptMedia = None,
    ) -> dict:  # fmt: skip
        """Sample one response per prompt (token id lists) -> {"responses": [ids], "logprobs":
        [per-token log-probs], "finished": [ended with a stop id], "version"}. seeds:
        [(seed, n)] covering the prompts in order, each n rows sampling what a request of
        those n prompts with that seed samples alone (the merged requests of
        serving/batching.py; the forward's float rounding at another batch shape aside);
        None: every row from s.seed, as one request. Either way the sampler's `seeds`
        (generation/base.py): a request alone draws from a generator seeded with s.seed, as
        the in-process rollout draws from the global RNG seeded the same; one sampling
        path, merged or not. The log-probs are the sampler's own (`logprobs`). media: each
        prompt's pixel inputs (None: a prompt without images; `row_media`)."""
        stops = self.checked_stops(prompts, s)
        pixels = self.row_media(prompts, media)
        pad = self.tokenizer.pad_token_id
        ids, mask = (t.to(self.device) for t in left_pad(prompts, pad))
        seeds = seeds or [(s.seed, len(prompts))]
        if s.partial:
            return self._generate_partial((ids, mask), s, stops, seeds)
        sampler = self._sampler_for(s)
        with self._current():
            try:
                got = sampler.sample(
                    ids, mask, s, stops, pad, seeds=seeds, logprobs=True, media=pixels
                )
            except ValueError as e:  # the model's own check: features and image tokens
                if pixels is None or pixels.joined() is None:
                    raise
                raise BadRequest(f"images: {str(e).splitlines()[0]}") from None
            assert got.logprobs is not None, "Sampler.sample(logprobs=True) without log-probs"
            out, response_mask, finished = truncate_after_eos(got.response_ids, stops, pad)
            version = self.version
        out, logprobs, n = out.cpu(), got.logprobs.float().cpu(), response_mask.sum(1).tolist()
        answer = {
            "responses": [row[:k].tolist() for row, k in zip(out, n)],
            "logprobs": [row[:k].tolist() for row, k in zip(logprobs, n)],
            "finished": finished.tolist(),
            "version": version,
        }
        if got.routing is not None:
            answer["routing"] = routing_rows(got.routing.cpu(), mask.cpu(), n)
        return answer

    def _generate_partial(
        self, prompt: tuple[torch.Tensor, torch.Tensor], s: SamplingRequest,
        stops: tuple[int, ...], seeds: list[tuple[int, int]],
    ) -> dict:  # fmt: skip
        """_generate's answer for a partial rollout (serving/partial.py), plus "versions":
        each response token's policy version; "version" is the one it ended under."""
        if self.engine is not None or s.routing:
            raise BadRequest("sampling.partial: the decode loop only, without routing")
        pad = self.tokenizer.pad_token_id
        with self._current():
            watch = PartialDecode(s.temperature, self.version, self._swap_staged)
            got = decode_partial(self.model, prompt, s, stops, pad, seeds, self.perf, watch)
            out, response_mask, finished = truncate_after_eos(got[0], stops, pad)
            version = self.version
        n = response_mask.sum(1).tolist()
        return {
            "responses": [row[:k].tolist() for row, k in zip(out.cpu(), n)],
            "logprobs": [row[:k].tolist() for row, k in zip(got[1].cpu(), n)],
            "versions": [row[:k].tolist() for row, k in zip(got[2], n)],
            "finished": finished.tolist(),
            "version": version,
        }

    def _swap_staged(self) -> int | None:
        """Under the lock, between decode steps or requests: the whole staged update into
        the served weights -> its version (None: none staged)."""
        ready = self.staging.take()
        if ready is None:
            return None
        version, items = ready
        with torch.no_grad():
            for spec, tensor in items:
                self._apply(spec, tensor)
        if self.adapter_parts:
            missing = sorted(self.adapter_parts)[:3]
            self.adapter_parts.clear()
            self.last_error = f"update {version}: LoRA matrices without their pair: {missing}"
        if self.engine is not None:  # the staging model holds the whole update now
            self.engine.load_weights(self.model)
        self.version = version
        return version

    def _swap_when_idle(self) -> None:
        """Swap a staged update in now if nothing holds the model; else the holder does, at
        its next step boundary or when it lets go (`_current`)."""
        if self.lock.acquire(blocking=False):
            try:
                self._swap_staged()
            finally:
                self.lock.release()

    def _sampler_for(self, s: SamplingRequest) -> Sampler:
        """The sampler of request `s`: the one recording the routing when it asks for it
        (BadRequest where none can)."""
        if not s.routing:
            return self.sampler
        if self.routed is None:
            raise BadRequest(
                "sampling.routing: needs a mixture-of-experts model served by the decode loop "
                "(this one has no router, or is served by vLLM)"
            )
        return self.routed

    @torch.no_grad()
    def _score(self, sequences: list[list[int]], temperature: float) -> dict:
        """Log-probs of tokens 1.. of each sequence given those before it, at `temperature`
        -> {"logprobs": [len - 1 floats each], "version"} (the post-sync check)."""
        self.check_ids(sequences, "sequences")
        if any(len(s) < 2 for s in sequences):
            raise BadRequest("sequences: each needs at least 2 tokens")
        if self.engine is not None:
            with self._current():
                return {"logprobs": self.engine.score(sequences, temperature), "version": self.version}  # fmt: skip
        ids, mask = (
            t.to(self.device) for t in right_pad(sequences, self.tokenizer.pad_token_id or 0)
        )
        predict = mask[:, 1:].bool()
        with self._current():
            logprobs, _ = token_logprobs(
                self.model, ids, mask, predict, temperature, perf=self.perf
            )
            version = self.version
        return {
            "logprobs": [row[m].tolist() for row, m in zip(logprobs.float().cpu(), predict.cpu())],
            "version": version,
        }

    @contextlib.contextmanager
    def _served(self) -> Iterator[tuple[torch.nn.Module, None]]:
        """The HFSampler's generation context: the served model, no ranks to keep in step
        (called under `_current`'s lock)."""
        yield self.model, None

    @contextlib.contextmanager
    def _current(self) -> Iterator[None]:
        """Hold the model lock, taken after every update announced so far is applied;
        Unavailable while an update that stopped half-way left the weights torn."""
        with self.pending_lock:
            waiting = list(self.pending)
        for future in waiting:
            # A failed update's error is in last_error; whole weights are still served.
            with contextlib.suppress(Exception):
                future.result(timeout=self.timeout_s)
        with self.pending_lock:
            self.pending = [f for f in self.pending if not f.done()]
        with self.lock:
            if self.torn:
                why = self.last_error or "see /health"
                raise Unavailable(
                    f"weights: update {self.torn} stopped half-way ({why}); the trainer's "
                    "next whole update serves again"
                )
            self._swap_staged()
            try:
                yield
            finally:
                self._swap_staged()  # staged while this held the lock: not left waiting

    def _queue(self, work: Callable[[], None]) -> None:
        """Run `work` on the update thread, after the updates queued before it."""
        with self.pending_lock:
            self.pending.append(self.updates.submit(self._logged, work))

    def join(
        self, address: str, port: int, rank: int, world_size: int, backend: str = "gloo"
    ) -> None:
        """Join trainer rank 0's weight-sync group in the background (its rank 0 blocks
        until every server joined); a later join replaces the group (a restarted trainer).
        `backend`: one of `local_backends()` (BadRequest otherwise), the trainer's pick."""
        if backend not in local_backends():
            raise BadRequest(
                f"backend: {backend!r} is not one this server can join ({local_backends()})"
            )

        def connect() -> None:
            self.group = SyncGroup(address, port, rank, world_size, self.timeout_s, backend)

        self.group = None
        self._queue(connect)

    def check_bucket(self, version: int, specs: list[TensorSpec]) -> None:
        """Refuse an update bucket whose metadata does not fit the model (BadRequest)."""
        if version <= self.version:
            raise BadRequest(f"version: {version} is not newer than the served {self.version}")
        for spec in specs:
            param = self.params.get(spec.name)
            if param is None:
                raise BadRequest(f"tensors: no parameter named {spec.name!r}")
            if spec.lora:
                _check_adapter(spec, tuple(param.shape))
            elif tuple(param.shape) != spec.shape:
                raise BadRequest(
                    f"tensors: {spec.name} has shape {list(param.shape)}, not {list(spec.shape)}"
                )
            if spec.dtype not in DTYPES:
                raise BadRequest(
                    f"tensors: {spec.name}: dtype {spec.dtype!r} not in {sorted(DTYPES)}"
                )

    def receive_bucket(
        self, version: int, specs: list[TensorSpec], final: bool, partial: bool = False
    ) -> None:
        """Queue the broadcast of one checked bucket; applied in order, under the lock, or
        with `partial` staged and swapped in whole between decode steps (`_swap_staged`)."""

        def receive() -> None:
            if self.group is None:
                raise RuntimeError("no weight-sync group: the trainer must call /init_weight_sync")
            group = self.group
            try:
                received = [
                    group.broadcast(
                        torch.empty(s.shape, dtype=DTYPES[s.dtype], device=group.device)
                    )
                    for s in specs
                ]
            except RuntimeError:
                # a broadcast that failed (peer gone, timeout) leaves the group unusable:
                # /health then reports none, and the trainer's next sync makes a new one
                self.group = None
                raise
            if partial:
                self.staging.add(version, list(zip(specs, received)), final)
                if final:
                    self._swap_when_idle()
                return
            # RLHF_DIST_FAULT=slow_update:N (tests): update N's version moves 1 s after its
            # broadcast ended, a window the trainer ranks must not read the old one in
            if final and fault_active("slow_update", version):
                time.sleep(1.0)
            with self.lock, torch.no_grad():
                self.torn = version  # until its final bucket is in (a trainer may die first)
                for spec, tensor in zip(specs, received):
                    self._apply(spec, tensor)
                if final and self.adapter_parts:
                    missing = sorted(self.adapter_parts)[:3]
                    self.adapter_parts.clear()
                    raise RuntimeError(
                        f"update {version}: LoRA matrices without their pair: {missing}"
                    )
                if final and self.engine is not None:  # the whole update is staged now
                    self.engine.load_weights(self.model)
                if final:
                    self.version, self.torn = version, 0

        self._queue(receive)

    def _apply(self, spec: TensorSpec, tensor: torch.Tensor) -> None:
        """Write one received tensor: a whole weight as it is; a LoRA matrix kept until its
        pair is in, then the weight becomes its frozen base + scale * B @ A (in fp32; the
        base is the weight as first served, copied the first time an adapter reaches it)."""
        param = self.params[spec.name]
        if not spec.lora:
            self.bases.pop(spec.name, None)  # a whole weight is the new base
            param.copy_(tensor)
            return
        parts = self.adapter_parts.setdefault(spec.name, {})
        parts[spec.lora] = tensor
        if len(parts) < 2:
            return
        del self.adapter_parts[spec.name]
        base = self.bases.setdefault(spec.name, param.detach().clone())
        # on the weight's device: B @ A of a 7B model's adapters is ~60 GFLOP
        a, b = (parts[k].to(param.device, torch.float32) for k in ("A", "B"))
        experts = param.shape[0] if param.dim() == 3 else 0
        param.copy_((base.float() + spec.scale * lora_delta(a, b, experts)).to(param.dtype))

    def _logged(self, work: Callable[[], None]) -> None:
        try:
            work()
            self.last_error = ""
        except Exception as e:  # the server keeps serving; /health says what failed
            self.last_error = f"{type(e).__name__}: {e}"
            raise
