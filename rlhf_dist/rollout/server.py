"""Rollouts from `rlhf-dist serve` processes (generation.backend=server; docs/serving.md).

`ServerEngine` has the in-process vLLM engine's face (rollout/vllm.py: load_weights,
generate, sleep), so collect.py samples through it unchanged. Before every rollout
trainer rank 0 sends the actor's whole weights (gathered once, as for vLLM) to every
server: each bucket's (name, shape, dtype) list and the new version over HTTP, then the
tensors by broadcast in the weight-sync group (distributed/weight_sync.py). Then the
post-sync check: every server scores fixed token sequences and the trainer compares
with its own log-probs; a mean gap above generation.server_sync_tolerance stops the run
(a sync that looked normal but left stale weights: trl#5312, verl#7495).

Each rank cuts its prompts into one contiguous shard per server (data-parallel servers)
and asks them concurrently, each shard with its own seed from torch's global RNG (so a
resumed run draws the same seeds). Every answer carries the policy version it was
sampled with; one that is not the version just synced is an error (the seam for
bounded staleness, issue 34 item 2). Standard library HTTP (urllib); every call times
out after distributed.timeout_s.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from rlhf_dist.checkpoint import fault_active
from rlhf_dist.config import Config, GenerationConfig
from rlhf_dist.distributed.weight_sync import SyncGroup, dtype_name, free_port, weight_buckets
from rlhf_dist.engine.forward import token_logprobs
from rlhf_dist.errors import ServerError
from rlhf_dist.rollout.vllm import hf_weights, prompts_for_engine, sampling_seeds

CHECK_ROWS, CHECK_TOKENS = 2, 16  # the post-sync check's fixed sequences


class ServerEngine:
    """The trainer's side of one or more rollout servers."""

    def __init__(self, cfg: Config, is_main: bool, any_rank: Callable[[bool], bool]):
        """is_main: this is trainer rank 0 (it syncs the weights); any_rank(flag): whether
        any trainer rank passed True (Runtime.any_rank; a collective, every rank calls it)."""
        g = cfg.generation
        self.urls = [u.rstrip("/") for u in g.server_urls]
        self.timeout_s = float(cfg.distributed.timeout_s)
        self._token = os.environ.get(g.server_token_env, "") if g.server_token_env else ""
        self.bucket_bytes = int(g.server_sync_bucket_mb * 2**20)
        self.tolerance, self.address = g.server_sync_tolerance, g.server_sync_address
        self.is_main, self.any_rank = is_main, any_rank
        self.group: SyncGroup | None = None
        self.version = 0  # the policy version every server holds after the last sync
        self.syncs = 0  # weight syncs of this run (RLHF_DIST_FAULT=skip_weight_sync:N)

    def call(self, url: str, path: str, body: dict | None = None) -> dict:
        """One HTTP call (GET without a body) -> its JSON answer; ServerError otherwise."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        request = urllib.request.Request(url + path, data, headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as e:
            detail = e.read(300).decode("utf-8", "replace").strip()
            raise ServerError(f"rollout server {url}{path}: HTTP {e.code} {detail}") from None
        except (urllib.error.URLError, OSError, ValueError) as e:
            why = getattr(e, "reason", e)
            raise ServerError(
                f"rollout server {url}{path}: {why} (within {self.timeout_s:g} s)"
            ) from None

    def together(self, work: Callable[[], object]):
        """work()'s result; when it raised ServerError on any trainer rank, ServerError on
        every rank at once (so they stop, and checkpoint, together; no rank is left
        waiting in a collective)."""
        error, result = None, None
        try:
            result = work()
        except ServerError as e:
            error = e
        if self.any_rank(error is not None):
            raise error or ServerError("rollout server: another trainer rank's call failed")
        return result

    def load_weights(self, actor: torch.nn.Module) -> None:
        """Send `actor`'s whole weights to every server as a new version (rank 0), check
        them, and let every rank learn the version (collective over the trainer ranks)."""
        self.syncs += 1
        if self.is_main:
            self.together(lambda: self._send_and_check(actor))
        else:
            self.together(lambda: None)  # waits for rank 0's sync (the flag's all-reduce)
            self.together(self._read_version)

    def _send_and_check(self, actor: torch.nn.Module) -> None:
        self._send(actor)
        self._check(actor)

    def _read_version(self) -> None:
        self.version = max(self.call(url, "/health")["version"] for url in self.urls)

    def _send(self, actor: torch.nn.Module) -> None:
        if self.group is None:
            self._join()
        version = 1 + max(self.call(url, "/health")["version"] for url in self.urls)
        self.version = version
        if fault_active("skip_weight_sync", self.syncs):
            return  # a fault for the tests: the servers keep their old weights
        buckets = list(weight_buckets(hf_weights(actor), self.bucket_bytes))
        for i, bucket in enumerate(buckets):
            tensors = [t.contiguous().cpu() for _, t in bucket]
            specs = [
                {"name": name, "shape": list(t.shape), "dtype": dtype_name(t.dtype)}
                for (name, _), t in zip(bucket, tensors)
            ]
            body = {"version": version, "tensors": specs, "final": i == len(buckets) - 1}
            for url in self.urls:
                self.call(url, "/update_weights", body)
            assert self.group is not None
            for t in tensors:
                self.group.broadcast(t)

    def _join(self) -> None:
        """Make the weight-sync group: rank 0 here, server i rank i + 1."""
        port, world = free_port(self.address), 1 + len(self.urls)
        for i, url in enumerate(self.urls):
            body = {"address": self.address, "port": port, "rank": i + 1, "world_size": world}
            self.call(url, "/init_weight_sync", body)
        self.group = SyncGroup(self.address, port, 0, world, self.timeout_s)

    @torch.no_grad()
    def _check(self, actor: torch.nn.Module) -> None:
        """The post-sync check: the servers' log-probs of fixed sequences against the
        actor's at temperature 1; ServerError when the mean gap exceeds the tolerance."""
        vocab = int(actor.get_input_embeddings().weight.shape[0])
        device = next(actor.parameters()).device
        seqs = torch.randint(
            0, vocab, (CHECK_ROWS, CHECK_TOKENS), generator=torch.Generator().manual_seed(0)
        )
        ids = seqs.to(device)
        predict = torch.ones(CHECK_ROWS, CHECK_TOKENS - 1, dtype=torch.bool, device=device)
        ours, _ = token_logprobs(actor, ids, torch.ones_like(ids), predict, 1.0)
        for url in self.urls:
            answer = self.call(url, "/score", {"sequences": seqs.tolist(), "temperature": 1.0})
            theirs = torch.tensor(answer["logprobs"], dtype=torch.float32)
            gap = float((ours.float().cpu() - theirs).abs().mean())
            if not gap <= self.tolerance:
                raise ServerError(
                    f"post-sync check: {url} scores fixed sequences {gap:.3g} nats per token away "
                    f"from the trainer after weight version {self.version} "
                    f"(generation.server_sync_tolerance {self.tolerance:g}): it does not hold the "
                    "trained weights"
                )

    def generate(self, prompt_ids, prompt_mask, gen_cfg: GenerationConfig, stop_ids, pad_id: int):
        """Sample one response per left-padded prompt (B, P) on the servers -> (response_ids
        (B, T) PAD after each response, sampler_logprobs (B, T) float32, 0 on padding)."""
        rows = [r["prompt_token_ids"] for r in prompts_for_engine(prompt_ids, prompt_mask)]
        bounds = torch.linspace(0, len(rows), len(self.urls) + 1).round().long().tolist()
        shards = [(u, rows[a:b]) for u, a, b in zip(self.urls, bounds, bounds[1:]) if b > a]
        seeds = sampling_seeds(len(shards)).tolist()
        sampling = {
            "max_new_tokens": gen_cfg.max_new_tokens, "min_new_tokens": gen_cfg.min_new_tokens,
            "temperature": gen_cfg.temperature, "top_k": gen_cfg.top_k, "top_p": gen_cfg.top_p,
            "stop_token_ids": [int(i) for i in stop_ids],
        }  # fmt: skip

        def ask(i: int) -> dict:
            url, prompts = shards[i]
            body = {"prompts": prompts, "sampling": {**sampling, "seed": seeds[i]}}
            return self.call(url, "/generate", body)

        def ask_all() -> tuple[list, list]:
            with ThreadPoolExecutor(max_workers=len(shards)) as pool:
                answers = list(pool.map(ask, range(len(shards))))
            responses, logprobs = [], []
            for (url, _), answer in zip(shards, answers):
                if answer["version"] != self.version:
                    raise ServerError(
                        f"rollout server {url}: sampled with policy version "
                        f"{answer['version']}, the trainer synced version {self.version}"
                    )
                responses += answer["responses"]
                logprobs += answer["logprobs"]
            return responses, logprobs

        responses, logprobs = self.together(ask_all)
        return _padded(responses, logprobs, pad_id, prompt_ids.device)

    def sleep(self) -> None:
        """Nothing to free in this process: the engine lives in the servers."""


def _padded(responses: list[list[int]], logprobs: list[list[float]], pad_id: int, device):
    """Right-padded (B, T) ids (pad_id) and float32 log-probs (0), T >= 1."""
    T = max(1, max(len(r) for r in responses))
    ids = torch.full((len(responses), T), pad_id, dtype=torch.long)
    lp = torch.zeros(len(responses), T, dtype=torch.float32)
    for b, (r, p) in enumerate(zip(responses, logprobs)):
        ids[b, : len(r)] = torch.tensor(r, dtype=torch.long)
        lp[b, : len(p)] = torch.tensor(p, dtype=torch.float32)
    return ids.to(device), lp.to(device)
