"""What the offline preference trainers (DPO, KTO) share: the policy and its frozen
reference, sequence log-probabilities of responses, the reference log-prob table computed
once before training, and the export of the trained policy.

The reference is the starting policy. Full fine-tuning loads a second, frozen copy of
model.policy (replicated or ZeRO-3-partitioned like PPO's reference). With LoRA it is the
trained model's own base with its adapters disabled (`AdapterOffReference`): no second copy,
and exact because the base is frozen and fresh adapters start at zero (docs/architecture.md
section 6).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from rlhf_dist.algo.preference import sequence_logprobs
from rlhf_dist.checkpoint import Checkpoint
from rlhf_dist.config import Config, PerfConfig
from rlhf_dist.data.chat import export_tokenizer
from rlhf_dist.data.rows import SFT_KEYS, SFTExample, collate_sft
from rlhf_dist.data.vision import VisionInputs
from rlhf_dist.distributed import Runtime, strided_map
from rlhf_dist.engine.forward import DEFAULT_PERF, token_logprobs
from rlhf_dist.files import atomic_write_text
from rlhf_dist.models import frozen_dtype, load_causal_lm, train_dtype, trained_load_dtype
from rlhf_dist.models.lora import AdapterOffReference, add_adapters, export_lora
from rlhf_dist.trainers.common import (
    GlobalBatch,
    StepSection,
    Trained,
    prepare_single_model,
    save_pretrained,
    save_processor,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rlhf_dist.data.batching import BatchPlan

REFERENCE_FILE = "reference_logprobs.json"


def response_batch(
    seqs: list[SFTExample], pad_id: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """Right-padded prompt+response sequences: input_ids, attention_mask (B, L) and
    response_mask (B, L-1), True where token t+1 is a response token (collate_sft's mask of
    the shifted positions, the one polarity: True on real response tokens)."""
    batch = collate_sft(seqs, pad_id)
    return {
        "input_ids": batch["input_ids"].to(device),
        "attention_mask": batch["attention_mask"].to(device),
        "response_mask": batch["loss_mask"].to(device),
    } | {k: v.to(device) for k, v in batch.items() if k not in SFT_KEYS}  # pixel inputs


# The text tensors of a `response_batch`; the rest are a vision batch's pixel inputs.
RESPONSE_KEYS = ("input_ids", "attention_mask", "response_mask")


def media_of(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """The pixel inputs of a `response_batch` (data/vision.py), None for a text batch."""
    return {k: v for k, v in batch.items() if k not in RESPONSE_KEYS} or None


def response_logprobs(
    model: nn.Module, batch: dict[str, torch.Tensor], perf: PerfConfig = DEFAULT_PERF
) -> torch.Tensor:
    """log pi(response | prompt) of each sequence of a `response_batch` under a causal LM;
    (B,) float32 (gradients flow when called with grad enabled)."""
    mask = batch["response_mask"]
    # Temperature 1: no sampling is involved, the labelled responses are scored as given.
    ids, attention = batch["input_ids"], batch["attention_mask"]
    logprobs, _ = token_logprobs(model, ids, attention, mask, perf=perf, media=media_of(batch))
    return sequence_logprobs(logprobs, mask)


@torch.no_grad()
def reference_logprobs(
    runtime: Runtime,
    reference: nn.Module,
    batch: dict[str, torch.Tensor],
    perf: PerfConfig = DEFAULT_PERF,
) -> torch.Tensor:
    """`response_logprobs` under the frozen reference, in the training forward's precision."""
    with runtime.autocast():
        return response_logprobs(reference, batch, perf).float()


def build_policy(
    cfg: Config,
    runtime: Runtime,
    section: StepSection,
    n_examples: int,
    ckpt: Checkpoint | None,
) -> tuple[Trained, BatchPlan, list[GlobalBatch]]:
    """The trained policy (LoRA adapters on it with lora.enabled), prepared with its optimizer
    and schedule as SFT/RM models are; returns (trained, plan, batches) of prepare_single_model."""
    m, lora = cfg.model, cfg.lora
    dtype = trained_load_dtype(
        train_dtype(m), runtime.zero_stage is not None, frozen_base=lora.enabled
    )
    net = load_causal_lm(m.policy, "model.policy", dtype, m, lora.enabled and lora.load_in_4bit)
    if lora.enabled:
        net = add_adapters(net, lora, "CAUSAL_LM")
    return prepare_single_model(cfg, runtime, net, section, n_examples, ckpt)


def build_reference(cfg: Config, runtime: Runtime, model: nn.Module) -> nn.Module:
    """The frozen reference policy: the adapters-off base under LoRA, else a frozen copy."""
    if cfg.lora.enabled:
        return AdapterOffReference(lambda: runtime.unwrap(model))
    m = cfg.model
    with runtime.local_loading():  # ZeRO-3 engines may exist by now
        reference = load_causal_lm(m.policy, "model.policy", frozen_dtype(m), m)
    placement = cfg.distributed.frozen_models
    return runtime.prepare_frozen(reference, placement, frozen_dtype(m), "reference")


def _fingerprint(cfg: Config, seqs: list[SFTExample]) -> str:
    """What a saved table was computed from: the reference model's path and every sequence."""
    h = hashlib.sha256(f"{cfg.model.policy}|{cfg.lora.enabled}".encode())
    for s in seqs:
        h.update(json.dumps([s.prompt_len, s.ids]).encode())
        for name, tensor in sorted((s.media or {}).items()):  # a vision row's images
            h.update(name.encode() + tensor.numpy().tobytes())
    return h.hexdigest()


@torch.no_grad()
def all_response_logprobs(
    runtime: Runtime,
    reference: nn.Module,
    seqs: list[SFTExample],
    size: int,
    pad_id: int,
    perf: PerfConfig = DEFAULT_PERF,
) -> torch.Tensor:
    """Reference log-probs of every sequence, (N,) on every rank: each rank scores every
    world_size-th one, in lock-step passes (a partitioned reference gathers per forward;
    distributed/lockstep.py)."""

    def forward(chunk: list[SFTExample]) -> torch.Tensor:
        batch = response_batch(chunk, pad_id, runtime.device)
        return reference_logprobs(runtime, reference, batch, perf)

    filler = [SFTExample([pad_id, pad_id], 1)]
    return torch.tensor(strided_map(runtime, seqs, size, forward, filler), dtype=torch.float32)


def reference_table(
    cfg: Config,
    runtime: Runtime,
    reference: nn.Module,
    seqs: list[SFTExample],
    size: int,
    pad_id: int,
    out: Path,
) -> torch.Tensor:
    """log pi_ref of every sequence, (N,) float32, computed once before training.

    Kept in <output_dir>/reference_logprobs.json. A resumed run (run.resume set) reads it
    back instead of scoring again when it was computed from the same model path and the same
    sequences; a fresh run always scores (the model at that path may have been retrained).
    JSON floats round-trip float32 values exactly.
    """
    path, fingerprint = out / REFERENCE_FILE, _fingerprint(cfg, seqs)
    if cfg.run.resume and path.is_file():
        saved = json.loads(path.read_text(encoding="utf-8"))
        if saved.get("fingerprint") == fingerprint:
            runtime.print(f"reference log-probs: read {len(seqs)} from {path}")
            return torch.tensor(saved["logprobs"], dtype=torch.float32)
    table = all_response_logprobs(runtime, reference, seqs, size, pad_id, cfg.perf)
    if runtime.is_main:
        saved = {"fingerprint": fingerprint, "logprobs": table.tolist()}
        atomic_write_text(path, json.dumps(saved) + "\n")
    runtime.barrier()
    runtime.print(f"reference log-probs: {len(seqs)} sequences scored once, kept in {path}")
    return table


def export_policy(
    cfg: Config,
    runtime: Runtime,
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    out: Path,
    vision: VisionInputs | None = None,
) -> None:
    """final/ = the trained policy (merged with lora.export merged/both), final_adapter/ =
    the LoRA adapter (adapter/both), each with a vision policy's processor. Every rank
    must call this."""
    m, lora, tokenizer = cfg.model, cfg.lora, export_tokenizer(tokenizer, cfg.data)
    if not lora.enabled:
        save_processor(runtime, vision, [out / "final"])  # first: the run's tokenizer wins
        save_pretrained(runtime, model, tokenizer, out / "final", dtype=train_dtype(m))
        return
    state = runtime.full_state_dict(model)
    if runtime.is_main:
        assert state is not None  # Runtime.full_state_dict gives it to the main process
        merged = out / "final" if lora.export in ("merged", "both") else None
        adapter = out / "final_adapter" if lora.export in ("adapter", "both") else None

        def base() -> nn.Module:
            return load_causal_lm(m.policy, "model.policy", train_dtype(m), m)

        with runtime.local_loading():
            export_lora(state, "", base, lora, "CAUSAL_LM", None, merged, adapter)
        save_processor(runtime, vision, list(filter(None, (merged, adapter))))
        for directory in filter(None, (merged, adapter)):
            tokenizer.save_pretrained(directory)
    runtime.barrier()
