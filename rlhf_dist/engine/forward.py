"""The sequence log-prob forward: log-probs (and entropies) of chosen tokens under a
causal LM, the one function every stage scores tokens with (`token_logprobs`).

How it runs fast, each behind a perf switch: the output head in chunks, logits
recomputed in backward, so no (B, T, V) tensor exists (perf.logprob_chunk_tokens;
algo.logprobs.logprobs_from_hidden); padding-free packed rows (perf.packed_sequences,
`packing`); and each distinct prompt of a rollout run once with its KV cache indexed out
to the rows that share it (perf.shared_prompt_forward; GRPO's n samples of a prompt).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from rlhf_dist.algo.logprobs import logprobs_and_entropy, logprobs_from_hidden
from rlhf_dist.algo.packing import unpack_tokens
from rlhf_dist.algo.prefix import unique_prompts
from rlhf_dist.config import PerfConfig
from rlhf_dist.data.vision import Media, token_inputs
from rlhf_dist.distributed.sequence_parallel import active_group
from rlhf_dist.distributed.zero3 import stays_whole, whole_tensors
from rlhf_dist.engine import packing
from rlhf_dist.engine.positions import is_mrope, mrope_ids_of, mrope_positions
from rlhf_dist.engine.sequence_parallel import KEY as SP_KEY
from rlhf_dist.engine.sequence_parallel import sequence_parallel_logprobs
from rlhf_dist.errors import ConfigError

# The speed paths of a caller that was given no config: perf's defaults.
DEFAULT_PERF = PerfConfig()
# A per-token term computed from the student's final hidden states, divergence(lm, hidden
# (N, H)) -> (N,), with lm the transformers model inside it (`token_forward`).
Divergence = Callable[[nn.Module, torch.Tensor], torch.Tensor]
# What a model does to its head's output before returning logits (`_logit_postprocessing`).
LogitPost = Callable[[torch.Tensor], torch.Tensor]


def causal_lm(model: nn.Module) -> nn.Module:
    """The transformers model inside `model`: under a DeepSpeed engine or DDP wrapper
    (`.module`) and a peft model (`get_base_model()`, with its adapters injected)."""
    from transformers import PreTrainedModel

    while not isinstance(model, PreTrainedModel):
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        elif isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
        else:
            raise TypeError(f"no transformers model inside {type(model).__name__}")
    return model


def token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    predict_mask: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    prompt_width: int | None = None,
    perf: PerfConfig = DEFAULT_PERF,
    media: Media | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """THE sequence log-prob function (docs/architecture.md section 10): log-probs (B, T) of
    the last T tokens of `input_ids` under causal LM `model` at the sampling `temperature`
    (N+ study: old, new and reference log-probs alike), each predicted from the position
    before it; entropies (B, T) of those predictions with `with_entropy`, else None.

    input_ids, attention_mask: (B, L); predict_mask: (B, T) bool, T < L, the tokens to
    score (response_mask for a rollout; the shifted loss mask, T = L - 1, for SFT/DPO/KTO).
    0 where predict_mask is False: those positions never reach the output head. `model`
    may be wrapped (engine, DDP, peft) or offer `scoring_model()` (lora.AdapterOffReference).
    The head runs over chunks of perf.logprob_chunk_tokens tokens (`head_logprobs`), so
    no (B, T, V) logits exist. Gradients flow when called with grad enabled.
    prompt_width: the first prompt_width columns are a left-padded prompt that rows may
    share (a rollout); with perf.shared_prompt_forward each distinct one is run once
    (`final_hidden_states`). perf: the speed paths (config.PerfConfig); each off gives the
    same values within the tolerances tests/unit/test_unit_perf_switches.py states.
    media: a vision-language model's pixel inputs of the batch's images by the processor's
    names (data/vision.py; pixel_values (n_images, ...), ...), passed to every forward.
    """
    lp, entropy, _ = token_forward(
        model,
        input_ids,
        attention_mask,
        predict_mask,
        temperature,
        with_entropy,
        prompt_width,
        perf,
        media=media,
    )
    return lp, entropy


def token_forward(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    predict_mask: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    prompt_width: int | None = None,
    perf: PerfConfig = DEFAULT_PERF,
    divergence: Divergence | None = None,
    media: Media | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`token_logprobs` (arguments alike), and with `divergence` a third output: a per-token
    term (B, T) computed in the same forward from the final hidden states of the scored
    positions, divergence(lm, hidden (N, H)) -> (N,) with N = predict_mask.sum() and lm the
    transformers model inside `model` (GJSD to a teacher, `chunked_divergence`); 0 where
    predict_mask is False. None without `divergence`. Inside `runtime.sequence_parallel()`
    (a pooled micro-batch) the forward is split over the group's ranks by columns
    (engine/sequence_parallel.py), giving the same tensors on every rank of the group."""
    if hasattr(model, "scoring_model"):
        with model.scoring_model() as inner:
            args = (input_ids, attention_mask, predict_mask, temperature, with_entropy)
            return token_forward(inner, *args, prompt_width, perf, divergence, media)
    predict_mask, lm = predict_mask.bool(), causal_lm(model)
    group = active_group()
    if group is not None:  # a pooled micro-batch, 1/n of its columns here (sequence_parallel)
        if divergence is not None:
            raise ConfigError(f"{SP_KEY}: on-policy distillation's gjsd loss is not supported")
        split = (input_ids, attention_mask, predict_mask, temperature, with_entropy, perf, group)
        return (*sequence_parallel_logprobs(model, lm, *split, head_logprobs), None)
    T = predict_mask.shape[1]
    inputs = (input_ids, attention_mask, T, prompt_width, perf, media)
    hidden, tokens = _scored_states(model, lm, *inputs)
    selected = predict_mask
    if not bool(predict_mask.any()):
        # Nothing to score (e.g. a micro-batch whose rows ppo.overlong=mask left out): score
        # one position times 0 below, so a backward still reaches the backbone and the head
        # (under ZeRO-3 every rank's backward must; DeepSpeed refuses a loss without a graph).
        hidden, tokens = hidden[:1, -1:], tokens[:1, -1:]
        selected = torch.ones_like(tokens, dtype=torch.bool)
    lp, entropy = head_logprobs(
        lm, hidden[selected], tokens[selected], temperature, perf.logprob_chunk_tokens, with_entropy
    )
    zeros = torch.zeros(predict_mask.shape, dtype=lp.dtype, device=lp.device)
    if selected is not predict_mask:
        anchor = 0.0 * lp.sum()
        lp = zeros + anchor
        empty = None if divergence is None else zeros.clone()
        return lp, None if entropy is None else zeros + 0.0 * entropy.sum(), empty
    div = None
    if divergence is not None:
        div = zeros.masked_scatter(predict_mask, divergence(lm, hidden[selected]).to(lp.dtype))
    lp = zeros.masked_scatter(predict_mask, lp)
    return lp, None if entropy is None else zeros.masked_scatter(predict_mask, entropy), div


def _scored_states(
    model: nn.Module,
    lm: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    T: int,
    prompt_width: int | None,
    perf: PerfConfig,
    media: Media | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(final hidden states (B, T, H) of the positions that predict the last T tokens,
    those tokens (B, T)) from one forward of `model` (`final_hidden_states`)."""
    L = input_ids.shape[1]
    full = final_hidden_states(model, lm, input_ids, attention_mask, prompt_width, perf, media)
    return full[:, L - 1 - T : L - 1], input_ids[:, L - T :]


@dataclass(frozen=True)
class TeacherStates:
    """What a frozen teacher gives `chunked_divergence` for one batch: its final hidden
    states (N, H_T) at the scored positions, and its output head, whole (weight (V_T, H_T),
    bias (V_T,) or None) with the post-processing of its logits (`_logit_postprocessing`)."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    post: LogitPost | None


@torch.no_grad()
def teacher_states(
    teacher: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    predict_mask: torch.Tensor,
    prompt_width: int | None = None,
    perf: PerfConfig = DEFAULT_PERF,
) -> TeacherStates:
    """The TeacherStates of frozen `teacher` at the N = predict_mask.sum() positions
    `token_logprobs` would score, in the same order; arguments as `token_logprobs`. Under
    ZeRO-3 with the teacher partitioned this is two collectives (its forward, and its head
    gathered once by zero3.whole_tensors): every rank calls it once per micro-batch, also
    one without a scored position."""
    lm, T = causal_lm(teacher), predict_mask.shape[1]
    hidden, _ = _scored_states(teacher, lm, input_ids, attention_mask, T, prompt_width, perf)
    head = lm.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise TypeError(
            f"a teacher's output head must be a linear layer, got {type(head).__name__}"
        )
    weight, *bias = whole_tensors([head.weight] + ([] if head.bias is None else [head.bias]))
    post = _logit_postprocessing(lm.config)
    return TeacherStates(hidden[predict_mask.bool()], weight, bias[0] if bias else None, post)


def final_hidden_states(
    model: nn.Module,
    lm: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_width: int | None = None,
    perf: PerfConfig = DEFAULT_PERF,
    media: Media | None = None,
) -> torch.Tensor:
    """The backbone's last hidden states (B, L, H) of `lm` (the transformers model inside
    `model`), from a forward of `model` itself: DeepSpeed's, DDP's and peft's forward
    logic all run. The model's own head runs on the last position only (logits_to_keep=1).
    With perf.packed_sequences the forward runs on the packed rows (`packing_layout`)
    and the states come back in the padded layout, 0 at padding. Otherwise, given a
    prompt_width and perf.shared_prompt_forward, the prompt columns run once per
    distinct prompt (`_shared_prompt_forward`). With `media` (pixel inputs, data/vision.py)
    the forward is one whole padded one: rows with equal prompt ids may hold different
    images, and packing is refused for images at load (models/vision.py)."""
    seen: list[torch.Tensor] = []
    backbone = getattr(lm, lm.base_model_prefix)
    layout = None if media else packing.packing_layout(lm, attention_mask, perf.packed_sequences)
    shared = not media and layout is None and prompt_width is not None and shares_prompts(lm, perf)

    def keep(module: nn.Module, args: tuple, output: Any) -> None:
        seen.append(output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])

    handle = backbone.register_forward_hook(keep)
    try:
        if shared:
            assert prompt_width is not None  # `shared` says so
            inverse = _shared_prompt_forward(model, input_ids, attention_mask, prompt_width)
            return torch.cat([seen[0].index_select(0, inverse), seen[1]], dim=1)
        inputs = packing.backbone_inputs(input_ids, attention_mask, layout)
        if layout is None:
            inputs["position_ids"] = positions_of(lm.config, input_ids, attention_mask, media)
        model(
            **inputs,
            **token_inputs(input_ids, media),
            logits_to_keep=1,
            # A whole-sequence forward needs no KV cache; transformers would otherwise
            # build one on every call (use_cache defaults to True in most configs), which
            # costs time on a small model and memory on a large one.
            use_cache=False,
        )
    finally:
        handle.remove()
    return seen[-1] if layout is None else unpack_tokens(seen[-1], layout[1])


def shares_prompts(lm: nn.Module, perf: PerfConfig) -> bool:
    """Whether rollout forwards of transformers model `lm` run each distinct prompt once:
    perf.shared_prompt_forward, no gradient checkpointing (transformers turns the KV
    cache off under it in training) and, when gradients are recorded, no ZeRO-3
    partitioned weights (its gradient buckets take each parameter once per backward; a
    second forward of the same modules hands them in twice: DeepSpeed asserts), and not a
    vision-language model (equal prompt ids may hold different images; deciding by the
    model, not by whether a batch has images, keeps a rank whose rows hold none at one
    forward too). The same answer on every rank (config, grad mode and the engine only),
    so ZeRO-3 ranks run the same number of forwards."""
    vision = getattr(getattr(lm, "config", None), "vision_config", None) is not None
    if not perf.shared_prompt_forward or vision:
        return False
    if getattr(lm, "is_gradient_checkpointing", False):
        return False
    first = next(lm.parameters(), None)
    return not (torch.is_grad_enabled() and first is not None and hasattr(first, "ds_id"))


def _shared_prompt_forward(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, P: int
) -> torch.Tensor:
    """Two forwards of `model` (algo/prefix.py): the U distinct prompts (U, P) with a KV
    cache, the cache indexed out to all B rows, then the B responses (B, L - P) on it.
    Always two, also when every prompt is distinct (U == B), so that the count does not
    depend on the data. Returns inverse (B,): row b's prompt is distinct prompt inverse[b].
    The backbone hook sees (U, P, H) and then (B, L - P, H)."""
    _, cache, inverse = prompt_cache(model, input_ids[:, :P], attention_mask[:, :P], True)
    model(
        input_ids=input_ids[:, P:],
        attention_mask=attention_mask,
        position_ids=packing.position_ids_from(attention_mask)[:, P:],
        use_cache=True,
        logits_to_keep=1,
        **cache,
    )
    return inverse


def model_config(model: nn.Module) -> Any:
    """The transformers config of the model inside `model` (peft, DeepSpeed and ActorCritic
    wrappers looked through); None for a module that holds no transformers model (a test's
    scripted stand-in), which then gets plain positions."""
    try:
        return causal_lm(model).config
    except TypeError:
        return None


def prompt_cache(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    share: bool,
    media: Media | None = None,
) -> tuple[Any, dict[str, Any], torch.Tensor | None]:
    """The prompt forward of left-padded prompts (B, P) with a KV cache, the model's head
    on the last position only. With `share` it runs over the distinct rows only
    (algo/prefix.py `unique_prompts`) and the cache is indexed out to the B rows
    (`Cache.reorder_cache`: index_select, so gradients sum over each group).
    Returns (the forward's output: U rows when shared, else B; the cache as `cache_of`
    gives it, B rows; inverse (B,): row b's prompt is output row inverse[b], None when
    not shared). media: the prompts' pixel inputs (data/vision.py), then never shared:
    equal prompt ids may hold different images."""
    inverse: torch.Tensor | None = None
    if share and not media:
        ids, mask, inverse = unique_prompts(prompt_ids, prompt_mask)
    else:
        ids, mask = prompt_ids, prompt_mask
    inputs = prefill_inputs(ids, mask, media, model_config(model))
    out = model(**inputs, use_cache=True, logits_to_keep=1)
    cache = cache_of(out)
    if inverse is not None:
        next(iter(cache.values())).reorder_cache(inverse)  # (U, ...) -> (B, ...)
    return out, cache, inverse


def prefill_inputs(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    media: Media | None = None,
    config: Any = None,
) -> dict[str, Any]:
    """The model inputs of a prefill over left-padded prompts (B, P): ids, mask, positions
    (`positions_of` the model `config`; None: counting real tokens) and a vision model's
    pixel inputs."""
    inputs = {
        "input_ids": prompt_ids,
        "attention_mask": prompt_mask,
        "position_ids": positions_of(config, prompt_ids, prompt_mask, media),
    }
    return inputs | token_inputs(prompt_ids, media)


def positions_of(
    config: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, media: Media | None
) -> torch.Tensor:
    """Position ids of left-padded rows (B, L) for a model of transformers `config`: (B, L)
    counting real tokens, or for an M-RoPE model (Qwen2-VL, engine/positions.py) its
    (3, B, L) temporal / height / width ids from the image tokens and `media`'s
    image_grid_thw (N, 3). Given explicitly, so that the model never derives them itself:
    transformers' Qwen2-VL keeps rope deltas between calls and expands 2-D ids to 3 equal
    axes, which misplaces every image token."""
    if config is None or not is_mrope(config):
        return packing.position_ids_from(attention_mask)
    grid = (media or {}).get("image_grid_thw")
    image_token_id, merge = mrope_ids_of(config)
    return mrope_positions(input_ids, attention_mask, grid, image_token_id, merge)[0]


def cache_of(output: Mapping[str, Any]) -> dict[str, Any]:
    """The KV cache a model output carries, under the keyword the model takes it back by
    (`cache` since transformers 5.2x, `past_key_values` before)."""
    if "cache" in output:
        return {"cache": output["cache"]}
    return {"past_key_values": output["past_key_values"]}


def head_logprobs(
    lm: nn.Module,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    chunk_tokens: int,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (N,) of `tokens` (N,) given final hidden states (N, H), through the output
    head of transformers model `lm`, chunk by chunk; entropies (N,) or None.

    chunk_tokens = 0 (perf.logprob_chunk_tokens off) is the reference: the whole (N, V)
    logits at once, under plain autograd.

    A plain linear head (tied embeddings alike) whose weights stay whole through the
    backward (no ZeRO-3, or inside `whole_weights`) goes to algo.logprobs'
    `logprobs_from_hidden`, which recomputes each chunk's logits in backward. Any other
    head (peft's LoRA or
    modules_to_save wrapper, a ZeRO-3 weight fetched per module, logits post-processed by
    the model) is called as a module per chunk, under activation checkpointing when
    gradients are recorded: the same memory bound, and ZeRO-3's hooks fetch the weight
    for each call (zero3.stays_whole).
    """
    head, post = lm.get_output_embeddings(), _logit_postprocessing(lm.config)
    params = [head.weight] if head.bias is None else [head.weight, head.bias]
    whole = all(stays_whole(p) for p in params)
    if chunk_tokens and type(head) is nn.Linear and post is None and whole:
        return logprobs_from_hidden(
            hidden, head.weight, tokens, head.bias, temperature, chunk_tokens, with_entropy
        )

    def chunk(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = head(h)
        return logprobs_and_entropy(logits if post is None else post(logits), t, temperature)

    if chunk_tokens == 0:
        lp, entropy = chunk(hidden, tokens)
        return lp, entropy if with_entropy else None

    grads = torch.is_grad_enabled() and (
        hidden.requires_grad or any(p.requires_grad for p in head.parameters())
    )
    parts: list[tuple[torch.Tensor, torch.Tensor]] = []
    for start in range(0, hidden.shape[0], chunk_tokens):
        h, t = hidden[start : start + chunk_tokens], tokens[start : start + chunk_tokens]
        parts.append(checkpoint(chunk, h, t, use_reentrant=False) if grads else chunk(h, t))
    if not parts:  # no token to score
        empty = hidden.new_zeros(0, dtype=torch.float32)
        parts = [(empty, empty)]
    lp = torch.cat([p[0] for p in parts])
    return lp, torch.cat([p[1] for p in parts]) if with_entropy else None


def chunked_divergence(
    lm: nn.Module,
    hidden: torch.Tensor,
    teacher: TeacherStates,
    divergence: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    chunk_tokens: int,
) -> torch.Tensor:
    """A per-token divergence (N,) between the student's next-token distributions at its
    final hidden states `hidden` (N, H), with gradient, and the teacher's (`teacher_states`
    of the same positions), without: divergence(logits (C, V), teacher_logits (C, V)) ->
    (C,) (algo.distill.generalized_jsd) on chunks of chunk_tokens rows (0: one chunk), each
    under activation checkpointing when gradients are recorded, so at most a few (chunk, V)
    tensors live in the forward and the backward, never (N, V) ones (151,936 columns for
    Qwen). lm: the student's transformers model (`causal_lm`).

    Each model's logits are post-processed as the model does (`_logit_postprocessing`) and
    cut to the vocabulary both have: embeddings are padded past the tokenizer differently
    by model size (Qwen2.5 0.5B: 151,936 rows, 7B: 152,064), and the padding rows are
    tokens no tokenizer produces. The student's head is called as a module (LoRA, ZeRO-3's
    fetch: as head_logprobs' module path); the teacher's was read whole once."""
    head, post = lm.get_output_embeddings(), _logit_postprocessing(lm.config)
    grads = torch.is_grad_enabled() and (
        hidden.requires_grad or any(p.requires_grad for p in head.parameters())
    )

    def chunk(h: torch.Tensor, th: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            t = F.linear(th.to(teacher.weight.dtype), teacher.weight, teacher.bias)
            t = t if teacher.post is None else teacher.post(t)
        s = head(h)
        s = s if post is None else post(s)
        v = min(s.shape[-1], t.shape[-1])
        return divergence(s[:, :v], t[:, :v])

    parts: list[torch.Tensor] = []
    step = chunk_tokens or max(hidden.shape[0], 1)
    for start in range(0, hidden.shape[0], step):
        h, th = hidden[start : start + step], teacher.hidden[start : start + step]
        parts.append(checkpoint(chunk, h, th, use_reentrant=False) if grads else chunk(h, th))
    if not parts:  # no position to score
        return hidden.new_zeros(0, dtype=torch.float32)
    return torch.cat(parts)


def _logit_postprocessing(config: Any) -> LogitPost | None:
    """What a model does to its head's output before returning logits, or None: Cohere's
    `logit_scale` (a product), Gemma 2/3's `final_logit_softcapping` (cap * tanh(z / cap))."""
    scale = getattr(config, "logit_scale", None)
    cap = getattr(config, "final_logit_softcapping", None)
    if scale in (None, 1.0) and cap is None:
        return None

    def post(logits: torch.Tensor) -> torch.Tensor:
        logits = logits if scale in (None, 1.0) else logits * scale
        return logits if cap is None else torch.tanh(logits / cap) * cap

    return post
