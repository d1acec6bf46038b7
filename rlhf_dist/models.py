"""Loading the four models of RLHF and reading scores and values off them.

- policy / actor / reference: `AutoModelForCausalLM`.
- reward model: `AutoModelForSequenceClassification` (num_labels=1); the score of a
  sequence is the head applied to the hidden state of its LAST real token.
- critic: a backbone plus a scalar head, applied at every position (`ValueModel`),
  initialised from the reward model (the "N+" study: Huang et al. 2024, "The N+
  Implementation Details of RLHF with PPO"; docs/architecture.md section 11) or from the policy with a zero head.
- `ActorCritic` holds actor and critic in one module so one engine/optimizer serves both.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from rlhf_dist.algo.logprobs import logprobs_and_entropy, logprobs_from_hidden
from rlhf_dist.algo.packing import pack_tokens, packed_layout, unpack_tokens
from rlhf_dist.algo.prefix import unique_prompts
from rlhf_dist.chat import chat_for, stop_token_ids
from rlhf_dist.config import ModelConfig
from rlhf_dist.distributed.zero3 import stays_whole
from rlhf_dist.errors import ConfigError

# Names classification heads go by in transformers (Llama/GPT-2/Mistral: score;
# BERT-likes: classifier). A head missing from a checkpoint must fail loudly
# (OpenRLHF #209/#428: renamed heads were silently re-initialised).
HEAD_NAMES = ("score", "classifier", "v_head", "value_head")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# model.logprob_chunk_tokens' default, for callers that were given no config.
LOGPROB_CHUNK_TOKENS = ModelConfig.logprob_chunk_tokens


def quiet_transformers() -> None:
    """Silence load reports, progress bars and library deprecation notices that would
    flood every rank's console (none of them is something a user can act on)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not torch.cuda.is_available():
        # Tell DeepSpeed up front, or every rank warns that it "was unable to detect" a GPU.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    libraries = r"(torch|transformers|deepspeed|accelerate|peft|datasets)(\.|$)"
    warnings.filterwarnings("ignore", category=FutureWarning, module=libraries)
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=libraries)
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)


def _load_kwargs(source, dtype: str) -> dict:
    """from_pretrained arguments; `source` is the run's ModelConfig (None: safe defaults)."""
    kwargs = {
        "trust_remote_code": bool(getattr(source, "trust_remote_code", False)),
        "use_safetensors": True if getattr(source, "safetensors_only", True) else None,
        "dtype": DTYPES[dtype],
    }
    attn = getattr(source, "attn_implementation", "auto")
    if attn != "auto":
        kwargs["attn_implementation"] = attn
    return kwargs


def _from_pretrained(loader, path: str, key: str, **kwargs):
    """`loader.from_pretrained(path)`, with a missing or unreadable model as a ConfigError."""
    if not path:
        raise ConfigError(f"{key}: no model path given")
    local = Path(path).expanduser()
    if path.startswith((".", "/", "~")) and not local.exists():
        raise ConfigError(f"{key}: model path {path!r} does not exist")
    try:
        return loader.from_pretrained(str(local) if local.exists() else path, **kwargs)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{key}: cannot load {path!r}: {first}") from None


def load_tokenizer(path: str, trust_remote_code: bool = False, key: str = "model.tokenizer"):
    """The tokenizer at `path` as it ships: PAD distinct from EOS (Qwen2.5), PAD == EOS
    (SmolLM2) and no PAD at all (Llama-3, Mistral) all load (docs/data.md, padding).

    Padding is bookkeeping: attention masks and `response_mask` say which positions are
    real, and no code finds EOS or a sequence's end by comparing ids with the PAD id. A
    tokenizer without PAD pads with its EOS id (already in the vocabulary: embeddings are
    never resized), said once; exports save the tokenizer without it again
    (`chat.export_tokenizer`).
    """
    from transformers import AutoTokenizer

    tok = _from_pretrained(AutoTokenizer, path, key, trust_remote_code=trust_remote_code)
    if tok.eos_token_id is None:
        raise ConfigError(f"{key}: tokenizer at {path!r} has no EOS token")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
        tok.rlhf_dist_pad_from_eos = True  # read by chat.export_tokenizer
        if path not in _SAID_NO_PAD:
            _SAID_NO_PAD.add(path)
            print(
                f"{key}: tokenizer at {path!r} has no PAD token; padding with EOS "
                f"({tok.eos_token!r}, id {tok.eos_token_id}): masks mark padding, not ids",
                flush=True,
            )
    return tok


_SAID_NO_PAD: set[str] = set()  # tokenizers already reported as padded with EOS


def load_causal_lm(
    path: str, key: str, dtype: str = "float32", source=None, load_in_4bit: bool = False
):
    """A causal LM with dropout off (dropout makes old and new log-probs disagree at ratio 1).

    load_in_4bit (QLoRA, lora.load_in_4bit): every linear layer but the output head in
    bitsandbytes NF4 (no double quantization, blocks of 64), computing in `dtype`, placed
    on this process's device (quantization happens as the weights land there)."""
    from transformers import AutoModelForCausalLM

    kwargs = _load_kwargs(source, dtype)
    if load_in_4bit:
        kwargs |= nf4_load_kwargs(dtype)
    model = _from_pretrained(AutoModelForCausalLM, path, key, **kwargs)
    # How `token_logprobs` chunks this model's head (model.logprob_chunk_tokens).
    model.logprob_chunk_tokens = getattr(source, "logprob_chunk_tokens", LOGPROB_CHUNK_TOKENS)
    mark_packing(model, source, key)
    # Whether rollout forwards run each distinct prompt once (model.shared_prompt_forward).
    model.shared_prompt_forward = bool(getattr(source, "shared_prompt_forward", False))
    return disable_dropout(model)


def nf4_load_kwargs(dtype: str) -> dict:
    """from_pretrained arguments for an NF4 base (docs/distributed.md, QLoRA)."""
    from transformers import BitsAndBytesConfig

    config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=False,
        bnb_4bit_compute_dtype=DTYPES[dtype],
    )
    cuda = torch.cuda.is_available()
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu"
    return {"quantization_config": config, "device_map": {"": device}}


def load_sequence_classifier(
    path: str,
    key: str,
    dtype: str = "float32",
    source=None,
    new_head: bool = False,
):
    """A num_labels=1 sequence classifier. Unless `new_head`, its head must come from `path`."""
    from transformers import AutoModelForSequenceClassification

    model, info = _from_pretrained(
        AutoModelForSequenceClassification,
        path,
        key,
        num_labels=1,
        output_loading_info=True,
        **_load_kwargs(source, dtype),
    )
    missing_head = [k for k in info["missing_keys"] if k.split(".")[0] in HEAD_NAMES]
    if missing_head and not new_head:
        raise ConfigError(
            f"{key}: {path!r} has no trained reward head ({', '.join(sorted(missing_head))} "
            "missing); train one with `rlhf-dist rm` first"
        )
    # No pad_token_id needed: scores are read at positions found from the attention mask
    # (ValueModel runs backbone + head), never by transformers' search for the first PAD,
    # which reads the token before EOS when PAD == EOS.
    mark_packing(model, source, key)
    return disable_dropout(model)


def trained_load_dtype(model_dtype: str, deepspeed: bool, frozen_base: bool) -> str:
    """The dtype to load a model that will be TRAINED in (docs/distributed.md, precision).

    bf16 asked for without DeepSpeed means fp32 weights and optimizer state with bf16
    compute (autocast): Adam's steps of ~lr (3e-6 at 1B scale) are below bf16's resolution
    near 1, so bf16 weights silently drop most updates. DeepSpeed keeps fp32 master
    weights itself, so there the module is loaded as asked. A LoRA base (`frozen_base`)
    is never updated and stays in the asked dtype; `upcast_trainable` then makes its
    adapters and heads fp32.
    """
    return model_dtype if deepspeed or frozen_base else "float32"


def upcast_trainable(model: nn.Module) -> nn.Module:
    """Trainable parameters (LoRA adapters, value heads) in fp32; frozen ones untouched."""
    for p in model.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
    return model


def enable_gradient_checkpointing(model: nn.Module) -> nn.Module:
    """Recompute each layer's activations in backward instead of storing them, in every
    transformers model inside `model` (an LM, a ValueModel, an ActorCritic; peft-wrapped
    or not).

    Memory for activations drops from all layers' to about one layer's (plus the layer
    inputs), for one extra forward per backward. Non-reentrant checkpointing: it needs
    no input that requires grad (a LoRA model's embeddings are frozen) and runs the
    recomputed forward under the same hooks (ZeRO-3 gathers the layer again). Only active
    in train mode, so rollout forwards are unaffected.
    """
    from transformers import PreTrainedModel

    done: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix) for prefix in done):
            continue  # inside a model already switched on (its backbone, peft's wrapper)
        target = module.get_base_model() if hasattr(module, "get_base_model") else module
        if isinstance(target, PreTrainedModel):
            target.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
            done.append(f"{name}." if name else "")
    return model


def disable_dropout(model: nn.Module) -> nn.Module:
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    for name in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if hasattr(model.config, name):
            setattr(model.config, name, 0.0)
    return model


def split_classifier(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(backbone, head) of a sequence classifier: backbone gives hidden states (B, L, H)."""
    if hasattr(model, "get_base_model"):  # peft: the transformers model with adapters injected
        model = model.get_base_model()
    backbone = getattr(model, model.base_model_prefix)
    for name in HEAD_NAMES:
        head = getattr(model, name, None)
        if isinstance(head, nn.Module):
            return backbone, head
    raise ConfigError(f"model: cannot find the classification head of {type(model).__name__}")


def position_ids_from(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counting real tokens only, so left padding does not shift them; (B, L)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


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
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    predict_mask: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
    with_entropy: bool = False,
    prompt_width: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """THE sequence log-prob function (docs/architecture.md section 10): log-probs (B, T) of
    the last T tokens of `input_ids` under causal LM `model` at the sampling `temperature`
    (N+ study: old, new and reference log-probs alike), each predicted from the position
    before it; entropies (B, T) of those predictions with `with_entropy`, else None.

    input_ids, attention_mask: (B, L); predict_mask: (B, T) bool, T < L, the tokens to
    score (response_mask for a rollout; the shifted loss mask, T = L - 1, for SFT/DPO/KTO).
    0 where predict_mask is False: those positions never reach the output head. `model`
    may be wrapped (engine, DDP, peft) or offer `scoring_model()` (lora.AdapterOffReference).
    The head runs over chunks of `chunk_tokens` tokens (`head_logprobs`; None: the
    `logprob_chunk_tokens` that `load_causal_lm` gave the model, model.logprob_chunk_tokens),
    so no (B, T, V) logits exist. Gradients flow when called with grad enabled.
    prompt_width: the first prompt_width columns are a left-padded prompt that rows may
    share (a rollout); with model.shared_prompt_forward each distinct one is run once
    (`final_hidden_states`).
    """
    if hasattr(model, "scoring_model"):
        with model.scoring_model() as inner:
            return token_logprobs(
                inner, input_ids, attention_mask, predict_mask, temperature, chunk_tokens,
                with_entropy, prompt_width,
            )  # fmt: skip
    L, T = input_ids.shape[1], predict_mask.shape[1]
    predict_mask, lm = predict_mask.bool(), causal_lm(model)
    if chunk_tokens is None:
        chunk_tokens = getattr(lm, "logprob_chunk_tokens", LOGPROB_CHUNK_TOKENS)
    full = final_hidden_states(model, lm, input_ids, attention_mask, prompt_width)  # (B, L, H)
    hidden, tokens = full[:, L - 1 - T : L - 1], input_ids[:, L - T :]
    selected = predict_mask
    if not bool(predict_mask.any()):
        # Nothing to score (e.g. a micro-batch whose rows ppo.overlong=mask left out): score
        # one position times 0 below, so a backward still reaches the backbone and the head
        # (under ZeRO-3 every rank's backward must; DeepSpeed refuses a loss without a graph).
        hidden, tokens = full[:1, -1:], input_ids[:1, -1:]
        selected = torch.ones_like(tokens, dtype=torch.bool)
    lp, entropy = head_logprobs(
        lm, hidden[selected], tokens[selected], temperature, chunk_tokens, with_entropy
    )
    zeros = torch.zeros(predict_mask.shape, dtype=lp.dtype, device=lp.device)
    if selected is not predict_mask:
        anchor = 0.0 * lp.sum()
        lp = zeros + anchor
        return lp, None if entropy is None else zeros + 0.0 * entropy.sum()
    lp = zeros.masked_scatter(predict_mask, lp)
    return lp, None if entropy is None else zeros.masked_scatter(predict_mask, entropy)


def final_hidden_states(model, lm, input_ids, attention_mask, prompt_width=None) -> torch.Tensor:
    """The backbone's last hidden states (B, L, H) of `lm` (the transformers model inside
    `model`), from a forward of `model` itself: DeepSpeed's, DDP's and peft's forward
    logic all run. The model's own head runs on the last position only (logits_to_keep=1).
    With model.packed_sequences the forward runs on the packed rows (`packing_layout`)
    and the states come back in the padded layout, 0 at padding. Otherwise, given a
    prompt_width and model.shared_prompt_forward, the prompt columns run once per
    distinct prompt (`_shared_prompt_forward`)."""
    seen = []
    backbone = getattr(lm, lm.base_model_prefix)
    layout = packing_layout(lm, attention_mask)
    shared = layout is None and prompt_width is not None and shares_prompts(lm)

    def keep(module, args, output):
        seen.append(output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])

    handle = backbone.register_forward_hook(keep)
    try:
        if shared:
            inverse = _shared_prompt_forward(model, input_ids, attention_mask, prompt_width)
            return torch.cat([seen[0].index_select(0, inverse), seen[1]], dim=1)
        model(
            **backbone_inputs(input_ids, attention_mask, layout),
            logits_to_keep=1,
            # A whole-sequence forward needs no KV cache; transformers would otherwise
            # build one on every call (use_cache defaults to True in most configs):
            # ~5% of a tiny model's training step, and memory on large ones.
            use_cache=False,
        )
    finally:
        handle.remove()
    return seen[-1] if layout is None else unpack_tokens(seen[-1], layout[1])


def shares_prompts(lm) -> bool:
    """Whether rollout forwards of transformers model `lm` run each distinct prompt once:
    model.shared_prompt_forward, no gradient checkpointing (transformers turns the KV
    cache off under it in training) and, when gradients are recorded, no ZeRO-3
    partitioned weights (its gradient buckets take each parameter once per backward; a
    second forward of the same modules hands them in twice: DeepSpeed asserts). The same
    answer on every rank (config, grad mode and the engine only), so ZeRO-3 ranks run the
    same number of forwards."""
    if not getattr(lm, "shared_prompt_forward", False):
        return False
    if getattr(lm, "is_gradient_checkpointing", False):
        return False
    first = next(lm.parameters(), None)
    return not (torch.is_grad_enabled() and first is not None and hasattr(first, "ds_id"))


def _shared_prompt_forward(model, input_ids, attention_mask, P: int) -> torch.Tensor:
    """Two forwards of `model` (algo/prefix.py): the U distinct prompts (U, P) with a KV
    cache, the cache indexed out to all B rows, then the B responses (B, L - P) on it.
    Always two, also when every prompt is distinct (U == B), so that the count does not
    depend on the data. Returns inverse (B,): row b's prompt is distinct prompt inverse[b].
    The backbone hook sees (U, P, H) and then (B, L - P, H)."""
    _, cache, inverse = distinct_prompt_cache(model, input_ids[:, :P], attention_mask[:, :P])
    model(
        input_ids=input_ids[:, P:], attention_mask=attention_mask,
        position_ids=position_ids_from(attention_mask)[:, P:], use_cache=True,
        logits_to_keep=1, **cache,
    )  # fmt: skip
    return inverse


def distinct_prompt_cache(model, prompt_ids, prompt_mask):
    """One forward of `model` over the distinct rows of left-padded prompts (B, P)
    (algo/prefix.py `unique_prompts`) with a KV cache, the cache then indexed out to the
    B rows (`Cache.reorder_cache`: index_select, so gradients sum over each group).
    Returns (the forward's output, U rows; the cache as `cache_of` gives it, B rows;
    inverse (B,): row b's prompt is distinct row inverse[b])."""
    ids, mask, inverse = unique_prompts(prompt_ids, prompt_mask)
    out = model(
        input_ids=ids, attention_mask=mask, position_ids=position_ids_from(mask),
        use_cache=True, logits_to_keep=1,
    )  # fmt: skip
    cache = cache_of(out)
    next(iter(cache.values())).reorder_cache(inverse)  # (U, ...) -> (B, ...)
    return out, cache, inverse


@contextlib.contextmanager
def grouped_query_attention_on_cpu():
    """Inside: transformers' sdpa attention hands grouped-query K/V of CPU tensors to
    torch's scaled_dot_product_attention as they are (enable_gqa) instead of first copying
    every KV head num_key_value_groups times (its repeat_kv). transformers turns enable_gqa
    on only without an attention mask, because CUDA's fused kernels then fall back to the
    math one; CPU's flash kernel takes the mask and the grouped heads alike and returns the
    same values bitwise. In a decode step the copy is of the whole KV cache, every layer:
    SmolLM2 (3 KV heads for 9) at 16 rows spends ~1 ms a layer on it, ~3x its attention.
    Process-wide while inside; a no-op where transformers lacks the hook."""
    from transformers.integrations import sdpa_attention

    original = getattr(sdpa_attention, "use_gqa_in_sdpa", None)
    if original is None:
        yield
        return

    def use_gqa(attention_mask, key, value):
        return key.device.type == "cpu" or original(attention_mask, key, value)

    sdpa_attention.use_gqa_in_sdpa = use_gqa
    try:
        yield
    finally:
        sdpa_attention.use_gqa_in_sdpa = original


def cache_of(output) -> dict:
    """The KV cache a model output carries, under the keyword the model takes it back by
    (`cache` since transformers 5.2x, `past_key_values` before)."""
    if "cache" in output:
        return {"cache": output["cache"]}
    return {"past_key_values": output["past_key_values"]}


def packing_layout(lm, attention_mask: torch.Tensor):
    """`algo.packing.packed_layout` of a batch for transformers model `lm` when its
    packed_sequences is on (model.packed_sequences, set by the loaders), else None (also
    when no row has a real token).

    Flash attention gets everything in ONE row: transformers reads sequence starts from
    position ids only in a batch of one (modeling_flash_attention_utils
    `_is_packed_sequence`) and runs its varlen kernels, whose cost stays per sequence.
    Every other implementation (eager, sdpa) gets bins of the padded width L: with no
    attention mask, masking_utils finds the sequences from the position ids
    (`find_packed_sequence_indices`) and builds a block-diagonal causal mask, whose cost
    grows with the row's length squared, so no packed row is longer than the padded one.
    """
    if not getattr(lm, "packed_sequences", False):
        return None
    B, L = attention_mask.shape
    flash = "flash" in str(getattr(lm.config, "_attn_implementation", None) or "")
    layout = packed_layout(attention_mask, B * L if flash else L)
    return None if layout[0].shape[0] == 0 else layout


def backbone_inputs(input_ids, attention_mask, layout) -> dict:
    """A whole-sequence forward's inputs: padded, positions counting real tokens; or
    packed by `layout` (packing_layout's), no attention mask, positions per sequence."""
    if layout is None:
        position_ids = position_ids_from(attention_mask)
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
        }
    gather, _, position_ids = layout
    return {
        "input_ids": pack_tokens(input_ids, gather),
        "attention_mask": None,
        "position_ids": position_ids,
    }


def mark_packing(model: nn.Module, source, key: str) -> None:
    """Give a freshly loaded transformers model its model.packed_sequences (read from
    `source`, the run's ModelConfig; off without one). On needs a backbone whose masks
    come from transformers' masking_utils (Llama, Qwen2/3, Mistral, Gemma, GPT-2, ...):
    only there does a forward without an attention mask keep attention inside each
    sequence the position ids delimit; any other backbone is a ConfigError."""
    on = bool(getattr(source, "packed_sequences", False))
    if on:
        import sys

        from transformers import masking_utils

        backbone = getattr(model, model.base_model_prefix)
        module = sys.modules.get(type(backbone).__module__)
        names = ("create_causal_mask", "create_sliding_window_causal_mask")
        if not any(getattr(module, n, None) is getattr(masking_utils, n) for n in names):
            raise ConfigError(
                f"model.packed_sequences: {key}'s {type(backbone).__name__} does not build "
                "its attention masks with transformers' masking_utils, so packed rows "
                "would attend across sequences; set model.packed_sequences=false"
            )
    model.packed_sequences = on


def head_logprobs(lm, hidden, tokens, temperature: float, chunk_tokens: int, with_entropy: bool):
    """Log-probs (N,) of `tokens` (N,) given final hidden states (N, H), through the output
    head of transformers model `lm`, chunk by chunk; entropies (N,) or None.

    A plain linear head (tied embeddings alike) whose weights stay whole through the
    backward (no ZeRO-3, or inside `whole_weights`) goes to `algo.logprobs_from_hidden`,
    which recomputes each chunk's logits in backward. Any other head (peft's LoRA or
    modules_to_save wrapper, a ZeRO-3 weight fetched per module, logits post-processed by
    the model) is called as a module per chunk, under activation checkpointing when
    gradients are recorded: the same memory bound, and ZeRO-3's hooks fetch the weight
    for each call (zero3.stays_whole).
    """
    head, post = lm.get_output_embeddings(), _logit_postprocessing(lm.config)
    params = [head.weight] if head.bias is None else [head.weight, head.bias]
    if type(head) is nn.Linear and post is None and all(stays_whole(p) for p in params):
        return logprobs_from_hidden(
            hidden, head.weight, tokens, head.bias, temperature, chunk_tokens, with_entropy
        )

    def chunk(h, t):
        logits = head(h)
        return logprobs_and_entropy(logits if post is None else post(logits), t, temperature)

    grads = torch.is_grad_enabled() and (
        hidden.requires_grad or any(p.requires_grad for p in head.parameters())
    )
    parts = []
    for start in range(0, hidden.shape[0], chunk_tokens):
        h, t = hidden[start : start + chunk_tokens], tokens[start : start + chunk_tokens]
        parts.append(checkpoint(chunk, h, t, use_reentrant=False) if grads else chunk(h, t))
    if not parts:  # no token to score
        parts = [(hidden.new_zeros(0, dtype=torch.float32),) * 2]
    lp = torch.cat([p[0] for p in parts])
    return lp, torch.cat([p[1] for p in parts]) if with_entropy else None


def _logit_postprocessing(config):
    """What a model does to its head's output before returning logits, or None: Cohere's
    `logit_scale` (a product), Gemma 2/3's `final_logit_softcapping` (cap * tanh(z / cap))."""
    scale = getattr(config, "logit_scale", None)
    cap = getattr(config, "final_logit_softcapping", None)
    if scale in (None, 1.0) and cap is None:
        return None

    def post(logits):
        logits = logits if scale in (None, 1.0) else logits * scale
        return logits if cap is None else torch.tanh(logits / cap) * cap

    return post


class ValueModel(nn.Module):
    """Backbone + scalar head applied at every position: per-token values or scores."""

    def __init__(self, classifier: nn.Module):
        super().__init__()
        split_classifier(classifier)  # fail early if it has no recognisable head
        # Kept whole (not as backbone + head) so that save_pretrained writes the
        # AutoModelForSequenceClassification checkpoint users load back.
        self.classifier = classifier

    def forward(self, input_ids, attention_mask, position_ids=None) -> torch.Tensor:
        """input_ids, attention_mask: (B, L). Returns (B, L) float32 head outputs.

        With model.packed_sequences the backbone and head run on the packed rows
        (`packing_layout`; position_ids must be None: positions restart per sequence)
        and the outputs come back in the padded layout, 0 at padding."""
        backbone, head = split_classifier(self.classifier)
        layout = packing_layout(causal_lm(self.classifier), attention_mask)
        inputs = backbone_inputs(input_ids, attention_mask, layout)
        if position_ids is not None:
            if layout is not None:
                raise ValueError("ValueModel: packed sequences take their own position ids")
            inputs["position_ids"] = position_ids
        hidden = backbone(**inputs, use_cache=False).last_hidden_state  # see final_hidden_states
        values = head(hidden).squeeze(-1).float()
        return values if layout is None else unpack_tokens(values, layout[1])


def sequence_scores(value_model: ValueModel, input_ids, attention_mask, last_index) -> torch.Tensor:
    """Score of each sequence read at `last_index` (B,), its last real token. Returns (B,)."""
    per_token = value_model(input_ids, attention_mask)
    return per_token.gather(1, last_index.long().unsqueeze(1)).squeeze(1)


class ActorCritic(nn.Module):
    """Actor and critic in one module: one `prepare`, one optimizer, one engine (TRL layout)."""

    def __init__(self, actor: nn.Module, critic: ValueModel | None):
        super().__init__()
        self.actor = actor
        self.critic = critic  # None: a critic-free estimator (grpo, rloo, reinforce_pp*)

    def forward(
        self,
        input_ids,
        attention_mask,
        response_mask,
        temperature: float = 1.0,
        with_entropy: bool = False,
        with_actor: bool = True,
        with_critic: bool = True,
        share_prompts: bool = True,
    ):
        """Log-probs, entropies and values at the positions that predict the last
        T = response_mask.shape[1] tokens.

        input_ids, attention_mask: (B, P+T) with left-padded prompt then response;
        response_mask: (B, T) bool. Returns logprobs (B, T) of the response tokens at the
        sampling `temperature` (0 outside response_mask; `token_logprobs`), entropies
        (B, T) or None (`with_entropy`), and values (B, T): position P-1+t predicts token
        P+t, and its value is V(prompt + response[:t]); values is None without a critic,
        logprobs and entropies None with with_actor=False (a critic-only pass), values None
        with with_critic=False (an actor-only pass: PPO-ptx's SFT rows, trainers/ptx.py).
        share_prompts: the first P columns are a prompt that rows may share
        (model.shared_prompt_forward); False for rows that are not prompt + response
        (PPO-ptx's SFT rows, where every column but the first is scored).
        """
        logprobs = entropy = values = None
        if with_actor:
            logprobs, entropy = token_logprobs(
                self.actor, input_ids, attention_mask, response_mask, temperature, None,
                with_entropy,
                input_ids.shape[1] - response_mask.shape[1] if share_prompts else None,
            )  # fmt: skip
        if self.critic is not None and with_critic:
            T = response_mask.shape[1]
            values = self.critic(input_ids, attention_mask)[:, -T - 1 : -1]
        return logprobs, entropy, values


def sub_state_dict(state: dict, prefix: str) -> dict:
    """The entries of a module's state dict under `prefix` (e.g. "actor.", "critic.classifier."),
    keyed as the submodule itself names them (the prefix removed)."""
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def frozen_dtype(model_cfg) -> str:
    """The dtype of the frozen models (reference, reward model): model.frozen_dtype, where
    "auto" means the training dtype model.dtype."""
    if model_cfg.frozen_dtype == "auto":
        return model_cfg.dtype
    return model_cfg.frozen_dtype


def tokenizer_for(cfg, model_key: str = "policy"):
    """The run's tokenizer: model.tokenizer if set, else the named model's own."""
    m = cfg.model
    if m.tokenizer:
        return load_tokenizer(m.tokenizer, m.trust_remote_code, "model.tokenizer")
    path = getattr(m, model_key) or m.policy
    return load_tokenizer(path, m.trust_remote_code, f"model.{model_key}")


def generation_eos_ids(path: str) -> tuple[int, ...]:
    """The eos_token_id of a model's generation_config.json (an id or a list: Llama 3
    instruct lists three), or () if it has none."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except (OSError, ValueError):  # no generation_config.json: the tokenizer's EOS only
        return ()
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def policy_stop_ids(cfg, tokenizer) -> tuple[int, ...]:
    """Every id that ends a sampled response (docs/data.md, stop tokens): the tokenizer's
    EOS, the policy's generation_config.eos_token_id, the chat template's end-of-turn token
    (when there is a template) and generation.stop_token_ids."""
    chat = None
    if cfg.data.chat_template or getattr(tokenizer, "chat_template", None):
        chat = chat_for(tokenizer, cfg.data, "data.chat_template")
    generation_eos = generation_eos_ids(cfg.model.policy) if cfg.model.policy else ()
    return stop_token_ids(tokenizer, chat, cfg.generation.stop_token_ids, generation_eos)


def build_critic(cfg, dtype: str = "float32") -> ValueModel:
    """Critic from the reward model (value head = RM head) or from the policy (zero head)."""
    m = cfg.model
    if cfg.ppo.critic_init == "reward":
        if not m.reward:
            raise ConfigError("ppo.critic_init: 'reward' needs model.reward (or use 'policy')")
        classifier = load_sequence_classifier(m.reward, "model.reward", dtype, m)
    else:
        classifier = load_sequence_classifier(m.policy, "model.policy", dtype, m, new_head=True)
        _, head = split_classifier(classifier)
        # A zero head starts every value at 0: no random value noise in the first advantages.
        nn.init.zeros_(head.weight)
        if getattr(head, "bias", None) is not None:
            nn.init.zeros_(head.bias)
    return ValueModel(classifier)
