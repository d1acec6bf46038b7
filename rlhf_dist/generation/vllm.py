"""vLLM as the rollout sampler: one in-process engine per rank (generation.backend=vllm).

The shape is TRL's "colocate": every `accelerate launch` process owns one vLLM engine
(no Ray, no server, no collective between engines) that samples that rank's shard of
prompts. The trainer stays the authority on probabilities: the PPO ratio's old
log-probs are recomputed by the actor as with the hf backend, and vLLM's own sampling
log-probs are kept only to measure (and optionally correct, ppo.rollout_correction) the gap between
the two samplers (docs/architecture.md, "Rollout backends").

Before every rollout the engine gets the actor's current weights, under ZeRO-3 inside
the same gather-once context the hf backend generates in, so a rollout never samples
from stale weights and a resumed run needs nothing of the engine's state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from rlhf_dist.config import Config, GenerationConfig
from rlhf_dist.data.vision import RowMedia
from rlhf_dist.distributed import before_destroy
from rlhf_dist.engine.decode import generate, pad_columns, truncate_after_eos
from rlhf_dist.engine.sampling import Sampling
from rlhf_dist.errors import ConfigError
from rlhf_dist.generation.base import (
    GenerationContext,
    OnPolicyInProcess,
    Samples,
    Seeds,
    StopIds,
)
from rlhf_dist.generation.vllm_images import (
    image_requests,
    register_llava_without_torchvision,
    vllm_name,
)
from rlhf_dist.models.loading import context_length, train_dtype
from rlhf_dist.models.vision import vision_config

if TYPE_CHECKING:
    pass

_MISSING = (
    "generation.backend=vllm: the vllm package is not installed "
    "(bash launch/setup.sh --vllm, or pip install -e .[vllm] on a GPU machine)"
)


class SyncError(RuntimeError):
    """vLLM's engine does not sample from the actor's current weights."""


def import_vllm() -> Any:
    """The vllm module, or a one-line ConfigError naming the key when it is missing."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # no INFO lines every rollout
    try:
        import vllm
    except ImportError:
        raise ConfigError(_MISSING) from None
    for logger_name, message in _EXPECTED_WARNINGS:
        logging.getLogger(logger_name).addFilter(_Drop(message))
    return vllm


# vLLM warnings that say nothing wrong in how we run it, dropped (logger, message):
_EXPECTED_WARNINGS = (
    # A rotary embedding's cos/sin table is built by vLLM, not read from a checkpoint, so a
    # weight sync (rightly) brings no tensor for it; vLLM keeps its own table.
    ("vllm.model_executor.model_loader.reload.layerwise", "RotaryEmbedding: Failed to load"),
    # The engine has no tokenizer (skip_tokenizer_init: token ids in and out, ours renders
    # the chat template), so warming up its chat renderer fails with a whole traceback.
    ("vllm.renderers.base", "Chat template warmup failed"),
)


class _Drop(logging.Filter):
    def __init__(self, message: str):
        super().__init__()
        self.message = message

    def filter(self, record: logging.LogRecord) -> bool:
        return self.message not in record.getMessage()


def _release_vllm_groups() -> None:
    """Tear down vLLM's process groups (made over ours for each rank's one-GPU engine)
    while ours still exists. Left to vLLM's exit hook, that runs after our process group
    was destroyed and raises "Invalid process group specified" on every rank of a run that
    went well. vLLM's teardown also destroys the default group; the hook then has nothing
    left to do."""
    from vllm.distributed import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.destroy_distributed_environment()


def sampling_seeds(
    n: int, device: torch.device | str | None = None, generator: torch.Generator | None = None
) -> torch.Tensor:
    """(n,) int64 seeds, one per request, from torch's global RNG (checkpointed, so a
    resumed run draws the same seeds) or from `generator`. Each request needs its own:
    vLLM seeds a request's sampler with its seed alone, so equal seeds give equal samples
    for the n copies of a prompt (samples_per_prompt) and correlated ones across prompts."""
    return torch.randint(0, 2**31 - 1, (n,), dtype=torch.long, device=device, generator=generator)


def group_seeds(seeds: Seeds) -> list[int]:
    """Each row's vLLM seed of `seeds` ([(seed, n)], generation/base.py Sampler.sample): a
    group of n rows gets the n seeds `sampling_seeds` draws from the global RNG seeded with
    `seed`, from a CPU generator of its own (the global RNG is left alone)."""
    return [
        row
        for seed, n in seeds
        for row in sampling_seeds(n, generator=torch.Generator("cpu").manual_seed(seed)).tolist()
    ]


def sampling_params(vllm: Any, gen_cfg: Sampling, stop_ids: StopIds, seed: int) -> Any:
    """vLLM's SamplingParams with the hf backend's meaning of every generation key.

    temperature, top_k (0 = off in both), top_p, max_new_tokens -> max_tokens,
    min_new_tokens -> min_tokens (stop ids suppressed until then, as in sample_next).
    It stops on exactly `stop_ids` and nothing else: a text engine has no tokenizer, and
    a vision engine's (its processor needs one) has its EOS ignored. logprobs=0: the
    log-prob of each sampled token.
    """
    return vllm.SamplingParams(
        n=1,
        temperature=gen_cfg.temperature,
        top_k=gen_cfg.top_k,
        top_p=gen_cfg.top_p,
        max_tokens=gen_cfg.max_new_tokens,
        min_tokens=gen_cfg.min_new_tokens,
        stop_token_ids=[int(i) for i in stop_ids],
        ignore_eos=True,
        logprobs=0,
        detokenize=False,
        seed=int(seed),
    )


def prompts_for_engine(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[dict]:
    """Left-padded (B, P) prompts -> B requests holding only their real tokens."""
    return [{"prompt_token_ids": row[m.bool()].tolist()} for row, m in zip(prompt_ids, prompt_mask)]


def responses_from_outputs(
    outputs: list[Any], pad_id: int, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM outputs of B requests -> (response_ids (B, T) int64 right-padded with pad_id,
    sampler_logprobs (B, T) float32, 0 on padding). T = the longest response (>= 1).

    Each sampled token carries the log-prob vLLM drew it with: with logprobs_mode
    "processed_logprobs", after temperature and top-k / top-p, the same distribution
    the hf backend samples from.
    """
    rows = [out.outputs[0] for out in outputs]
    T = max(1, max(len(r.token_ids) for r in rows))
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    logprobs = torch.zeros(len(rows), T, dtype=torch.float32)
    for b, r in enumerate(rows):
        n = len(r.token_ids)
        ids[b, :n] = torch.tensor(r.token_ids, dtype=torch.long)
        lp = [step[tok].logprob for step, tok in zip(r.logprobs or (), r.token_ids)]
        logprobs[b, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
    return ids.to(device), logprobs.to(device)


def hf_weights(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a causal LM under its checkpoint names, the form vLLM's
    weight loader reads. A peft model gives its base weights (inside merged_adapters:
    W + scale * B @ A) without the adapter tensors and peft's name wrapping."""
    for name, p in checkpoint_parameters(module):
        yield name, p.detach()


def checkpoint_parameters(module: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """`hf_weights`' names with the parameters themselves (under ZeRO-3: partitions, to be
    gathered by whoever reads them)."""
    if hasattr(module, "get_base_model"):  # peft PeftModel
        module = module.get_base_model()
    for name, p in module.named_parameters():
        if "lora_" in name or ".original_module." in name:
            continue
        yield name.replace(".base_layer.", ".").replace(".modules_to_save.default.", "."), p


def _rollout_length(cfg: Config) -> int:
    """The engine's max_model_len by default: the longest sequence a rollout samples
    (prompt + new tokens), within the model's context. Not the whole context (8k-128k
    tokens): vLLM refuses to start unless its KV cache holds one max_model_len sequence."""
    longest = cfg.data.max_prompt_length + cfg.generation.max_new_tokens
    context = context_length(cfg.model.policy, cfg.model.trust_remote_code)
    return min(longest, context) if context else longest


def _engine_args(
    cfg: Config, on_gpu: bool, sleeps: bool, vision: Any | None, synced: bool
) -> dict[str, Any]:
    """vllm.LLM's keyword arguments for model.policy. vision: its vision-language config
    (the engine then has a tokenizer, which vLLM's image processor needs); synced: every
    rollout loads the actor's weights before sampling, so a vision engine starts from
    dummy weights (vLLM cannot read a CLIP tower as transformers 5 saves it,
    vllm_images.py)."""
    g = cfg.generation
    kwargs: dict[str, Any] = dict(
        model=cfg.model.policy,
        # token ids in and out; our tokenizer decodes
        skip_tokenizer_init=vision is None,
        dtype=train_dtype(cfg.model),
        seed=cfg.run.seed,
        distributed_executor_backend="uni",
        logprobs_mode="processed_logprobs",
        trust_remote_code=cfg.model.trust_remote_code,
        enable_sleep_mode=sleeps,
        gpu_memory_utilization=g.vllm_gpu_memory_utilization,
    )
    kwargs["max_model_len"] = g.vllm_max_model_len or _rollout_length(cfg)
    kv_gib = g.vllm_kv_cache_gib or (0 if on_gpu else 1.0)
    if kv_gib:
        kwargs["kv_cache_memory_bytes"] = int(kv_gib * 2**30)
    if vision is not None and synced:
        kwargs["load_format"] = "dummy"
    if g.vllm_enforce_eager or not on_gpu:
        # No CUDA graphs, no torch.compile: on CPU compiling costs ~20 s at start-up
        # and gained nothing measurable on small models (docs/benchmarks.md).
        kwargs |= {"enforce_eager": True, "compilation_config": {"mode": 0}}
    return kwargs


class VLLMEngine(OnPolicyInProcess):
    """One rank's in-process vLLM engine: load the actor's weights, sample a rollout. A
    Sampler (generation/base.py) without versions: `sync` loads the actor's current
    weights before every rollout."""

    from_actor = False
    in_step = False  # no collective: each rank's engine samples its own shard

    def __init__(
        self, cfg: Config, device: torch.device, weights: GenerationContext | None = None
    ) -> None:
        """weights: () -> context yielding (actor, _) with the actor's whole weights, read
        by `sync` (None: an engine that only serves, rlhf-dist serve)."""
        self.weights = weights
        vllm = import_vllm()
        g, self.vllm, self.perf = cfg.generation, vllm, cfg.perf
        self.on_gpu = device.type == "cuda"
        self.sleeps = self.on_gpu and g.vllm_sleep
        # One engine in this process: vLLM's V1 engine otherwise runs in a child process,
        # which would hold a second copy of the weights and need them sent over IPC.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # a vision-language policy: images go in as multi_modal_data (vllm_images.py)
        self.vision = vision_config(cfg.model.policy, cfg.model.trust_remote_code)
        if self.vision is not None:
            register_llava_without_torchvision(vllm)
        kwargs = _engine_args(cfg, self.on_gpu, self.sleeps, self.vision, weights is not None)
        with _keep_set_num_threads():
            try:
                self.llm = vllm.LLM(**kwargs)
                # One token now: kernels refuse some shapes only when they first run.
                probe = vllm.SamplingParams(max_tokens=1, detokenize=False)
                self.llm.generate([{"prompt_token_ids": [0]}], probe, use_tqdm=False)
            except (ValueError, RuntimeError, NotImplementedError) as e:
                # e.g. CPU attention without the policy's head size ("Unsupported CPU
                # attention configuration: head_dim=16"): the user's model, said in one line.
                cause = (str(e).strip().splitlines() or [type(e).__name__])[-1]
                raise ConfigError(
                    f"generation.backend=vllm: vLLM cannot serve model.policy={cfg.model.policy!r}: {cause}"
                ) from e
        before_destroy(_release_vllm_groups)
        self.asleep = False
        self.checks_sync = cfg.debug.check_vllm_sync

    @torch.no_grad()
    def load_weights(self, module: torch.nn.Module) -> None:
        """Copy `module`'s current weights (whole tensors: under ZeRO-3 call this inside
        the generation gather) into the engine, in place."""
        self.wake()
        weights = hf_weights(module)
        if self.vision is not None:
            weights = ((vllm_name(name, self.vision), w) for name, w in weights)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.llm_engine.reset_prefix_cache()  # cached KV blocks came from old weights
        if self.vision is not None:  # and image features from an old vision tower
            self.llm.reset_mm_cache()
            self.llm.llm_engine.reset_encoder_cache()

    def generate(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, gen_cfg: Sampling,
        stop_ids: StopIds, pad_id: int, seeds: list[int] | None = None,
        media: RowMedia | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Sample one response per left-padded prompt (B, P) -> (response_ids (B, T),
        sampler_logprobs (B, T)); rows are in prompt order, PAD after each response.
        seeds: each row's vLLM seed (None: drawn from the global RNG); media: the rows'
        images (a vision-language policy's prompts, vllm_images.py)."""
        if seeds is None:
            seeds = sampling_seeds(prompt_ids.shape[0]).tolist()
        params = [sampling_params(self.vllm, gen_cfg, stop_ids, s) for s in seeds]
        if media is None:
            requests = prompts_for_engine(prompt_ids, prompt_mask)
        else:
            requests = image_requests(prompt_ids, prompt_mask, media)
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        return responses_from_outputs(outputs, pad_id, prompt_ids.device)

    def score(self, sequences: list[list[int]], temperature: float) -> list[list[float]]:
        """The engine's log-probs of tokens 1.. of each sequence given those before it
        (its prompt log-probs, one generated token discarded) at `temperature` 1 only:
        vLLM computes prompt log-probs from the raw logits."""
        if temperature != 1.0:
            raise ValueError(f"vLLM scores at temperature 1 only, not {temperature}")
        params = self.vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        outputs = self.llm.generate(
            [{"prompt_token_ids": list(seq)} for seq in sequences], params, use_tqdm=False
        )
        return [
            [step[tok].logprob for step, tok in zip(out.prompt_logprobs[1:], seq[1:])]
            for out, seq in zip(outputs, sequences)
        ]

    @torch.no_grad()
    def check_sync(
        self, actor: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
        gen_cfg: GenerationConfig, tokenizer: Any, stop_ids: StopIds,
    ) -> None:  # fmt: skip
        """Greedy tokens of the engine and of `actor` (whole weights) on the first rows of
        a rollout's prompts must agree; raise SyncError naming the first row that differs.

        Greedy is top_k=1 in both samplers: the argmax token, with no randomness, so any
        difference comes from the weights (or from kernels at a near-tie: bf16).
        """
        rows = slice(0, min(4, prompt_ids.shape[0]))
        n = min(8, gen_cfg.max_new_tokens)  # vLLM refuses min_tokens > max_tokens
        greedy = dataclasses.replace(
            gen_cfg, top_k=1, max_new_tokens=n, min_new_tokens=min(gen_cfg.min_new_tokens, n)
        )
        pad = tokenizer.pad_token_id
        ours = generate(
            actor, prompt_ids[rows], prompt_mask[rows], greedy, tokenizer, None, stop_ids,
            self.perf,
        )  # fmt: skip
        theirs, _ = self.generate(prompt_ids[rows], prompt_mask[rows], greedy, stop_ids, pad)
        ours, _, _ = truncate_after_eos(ours, stop_ids, pad)
        theirs, _, _ = truncate_after_eos(theirs, stop_ids, pad)
        width = max(ours.shape[1], theirs.shape[1])
        ours, theirs = pad_columns(ours, width, pad), pad_columns(theirs, width, pad)
        for b, (a, v) in enumerate(zip(ours.tolist(), theirs.tolist())):
            if a != v:
                raise SyncError(
                    f"debug.check_vllm_sync: greedy tokens differ on prompt row {b} after the "
                    f"weight sync (actor {a}, vLLM {v}): the engine does not hold the actor's weights"
                )

    def sleep(self) -> None:
        """GPU with generation.vllm_sleep: free the KV cache and move the weights off the
        GPU for the update (level 1); `load_weights` wakes the engine."""
        if self.sleeps and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def sync(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, gen: GenerationConfig,
        stop_ids: StopIds, tokenizer: Any,
    ) -> None:  # fmt: skip
        """Load the actor's whole weights (once per rollout, inside `weights`); with
        debug.check_vllm_sync compare greedy tokens on the first prompt rows."""
        assert self.weights is not None, "VLLMEngine.sync without the actor's weights"
        with self.weights() as (actor, _):
            self.load_weights(actor)
            if self.checks_sync:
                self.check_sync(actor, prompt_ids, prompt_mask, gen, tokenizer, stop_ids)

    def sample(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, gen: Sampling,
        stop_ids: StopIds, pad_id: int, rows_per_pass: int | None = None,
        seeds: Seeds | None = None, logprobs: bool = False, media: RowMedia | None = None,
    ) -> Samples:  # fmt: skip
        """`generate` of the whole shard at once (vLLM schedules its own batches), each
        row's seed from the global RNG, or from its group's seed (`group_seeds`); vLLM's
        log-probs always come with the tokens; a vision-language policy's rows with their
        images (`media`)."""
        rows = None if seeds is None else group_seeds(seeds)
        ids, sampled = self.generate(prompt_ids, prompt_mask, gen, stop_ids, pad_id, rows, media)
        return Samples(ids, sampled)


@contextlib.contextmanager
def _keep_set_num_threads() -> Iterator[None]:
    """vLLM's CPU worker replaces torch.set_num_threads, process-wide, by a function that
    only warns; the trainer's own thread settings (run.num_threads) must keep working."""
    original = torch.set_num_threads
    try:
        yield
    finally:
        torch.set_num_threads = original
