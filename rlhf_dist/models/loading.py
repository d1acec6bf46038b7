"""Loading the four models of RLHF: policy / actor / reference (`AutoModelForCausalLM`,
or `AutoModelForImageTextToText` for a vision-language policy: models/vision.py),
reward model and critic (`AutoModelForSequenceClassification`, num_labels=1), their
tokenizer and stop tokens, dtypes, dropout off and gradient checkpointing.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from rlhf_dist.config import Config, ModelConfig
from rlhf_dist.config.paths import missing_model
from rlhf_dist.data.chat import chat_for, stop_token_ids
from rlhf_dist.engine.sequence_parallel import checkpoint_contexts
from rlhf_dist.errors import ConfigError
from rlhf_dist.models.moe import prepare_moe
from rlhf_dist.models.vision import freeze_vision, keep_tower_in_step, vision_config

if TYPE_CHECKING:  # transformers loads only where a model or tokenizer does
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


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


def _load_kwargs(source: ModelConfig | None, dtype: str) -> dict:
    """from_pretrained arguments; `source` is the run's ModelConfig (None: safe defaults)."""
    kwargs: dict[str, Any] = {
        "trust_remote_code": bool(getattr(source, "trust_remote_code", False)),
        "use_safetensors": True if getattr(source, "safetensors_only", True) else None,
        "dtype": DTYPES[dtype],
    }
    attn = getattr(source, "attn_implementation", "auto")
    if attn != "auto":
        kwargs["attn_implementation"] = attn
    return kwargs


def _from_pretrained(loader: Any, path: str, key: str, **kwargs: Any) -> Any:
    """`loader.from_pretrained(path)`, with a missing or unreadable model as a ConfigError."""
    if not path:
        raise ConfigError(f"{key}: no model path given")
    missing = missing_model(path, key)
    if missing:
        raise ConfigError(missing)
    local = Path(path).expanduser()
    try:
        return loader.from_pretrained(str(local) if local.exists() else path, **kwargs)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{key}: cannot load {path!r}: {first}") from None


def load_tokenizer(
    path: str, trust_remote_code: bool = False, key: str = "model.tokenizer"
) -> PreTrainedTokenizerBase:
    """The tokenizer at `path` as it ships: PAD distinct from EOS (Qwen2.5), PAD == EOS
    (SmolLM2) and no PAD at all (Llama-3, Mistral) all load (docs/data.md, padding).

    Padding is bookkeeping: attention masks and `response_mask` say which positions are
    real, and no code finds EOS or a sequence's end by comparing ids with the PAD id. A
    tokenizer without PAD pads with its EOS id (already in the vocabulary: embeddings are
    never resized), said once; exports save the tokenizer without it again
    (`data.chat.export_tokenizer`).
    """
    from transformers import AutoTokenizer

    tok = _from_pretrained(AutoTokenizer, path, key, trust_remote_code=trust_remote_code)
    if tok.eos_token_id is None:
        raise ConfigError(f"{key}: tokenizer at {path!r} has no EOS token")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
        tok.rlhf_dist_pad_from_eos = True  # read by data.chat.export_tokenizer
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
    path: str,
    key: str,
    dtype: str = "float32",
    source: ModelConfig | None = None,
    load_in_4bit: bool = False,
) -> PreTrainedModel:
    """A causal LM with dropout off (dropout makes old and new log-probs disagree at ratio 1).

    load_in_4bit (QLoRA, lora.load_in_4bit): every linear layer but the output head in
    bitsandbytes NF4 (no double quantization, blocks of 64), computing in `dtype`, placed
    on this process's device (quantization happens as the weights land there)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    kwargs = _load_kwargs(source, dtype)
    if load_in_4bit:
        kwargs |= nf4_load_kwargs(dtype)
    if vision_config(path, kwargs["trust_remote_code"]) is None:
        model = _from_pretrained(AutoModelForCausalLM, path, key, **kwargs)
    else:
        # A vision-language model (docs/vision.md): its image-text-to-text class, the vision
        # tower and projector frozen unless model.freeze_vision says otherwise.
        model = _from_pretrained(AutoModelForImageTextToText, path, key, **kwargs)
        if getattr(source, "freeze_vision", True):
            freeze_vision(model)
        keep_tower_in_step(model, path, kwargs["trust_remote_code"])
    prepare_moe(model, source, key)  # mixture-of-experts: sparse blocks as ZeRO-3 leaves
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
    source: ModelConfig | None = None,
    new_head: bool = False,
) -> PreTrainedModel:
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
    prepare_moe(model, source, key)
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
            # context_fn: a layer recomputed under sequence parallelism attends as it did
            target.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={
                    "use_reentrant": False,
                    "context_fn": checkpoint_contexts,
                }
            )
            done.append(f"{name}." if name else "")
    return model


def disable_dropout(model: nn.Module) -> nn.Module:
    """Every dropout of `model` off, its modules' and its config's: with dropout on, the
    same forward twice gives different log-probs (the PPO ratio at 1 is not 1)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    for name in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if hasattr(model.config, name):
            setattr(model.config, name, 0.0)
    return model


def train_dtype(model_cfg: ModelConfig) -> str:
    """The training precision model.dtype asks for: "auto" is bfloat16 where a CUDA GPU
    supports it, else float32 (the same answer on every rank of a run)."""
    if model_cfg.dtype != "auto":
        return model_cfg.dtype
    gpu = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return "bfloat16" if gpu else "float32"


def uses_checkpointing(model_cfg: ModelConfig) -> bool:
    """model.gradient_checkpointing, where null means on with a GPU, off on CPU."""
    if model_cfg.gradient_checkpointing is None:
        return torch.cuda.is_available()
    return model_cfg.gradient_checkpointing


def frozen_dtype(model_cfg: ModelConfig) -> str:
    """The dtype of the frozen models (reference, reward model): model.frozen_dtype, where
    "auto" means the training dtype (`train_dtype`)."""
    if model_cfg.frozen_dtype == "auto":
        return train_dtype(model_cfg)
    return model_cfg.frozen_dtype


def tokenizer_for(cfg: Config, model_key: str = "policy") -> PreTrainedTokenizerBase:
    """The run's tokenizer: model.tokenizer if set, else the named model's own."""
    m = cfg.model
    if m.tokenizer:
        return load_tokenizer(m.tokenizer, m.trust_remote_code, "model.tokenizer")
    path = getattr(m, model_key) or m.policy
    return load_tokenizer(path, m.trust_remote_code, f"model.{model_key}")


def context_length(path: str, trust_remote_code: bool = False) -> int | None:
    """The longest sequence a model's positions cover (config.json's
    max_position_embeddings), or None where its config does not say."""
    from transformers import AutoConfig

    config = _from_pretrained(AutoConfig, path, "model.policy", trust_remote_code=trust_remote_code)
    text = getattr(config, "text_config", None) or config  # multimodal configs nest it
    n = getattr(text, "max_position_embeddings", None)
    return int(n) if n else None


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


def policy_stop_ids(cfg: Config, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """Every id that ends a sampled response (docs/data.md, stop tokens): the tokenizer's
    EOS, the policy's generation_config.eos_token_id, the chat template's end-of-turn token
    (when there is a template) and generation.stop_token_ids."""
    chat = None
    if cfg.data.chat_template or getattr(tokenizer, "chat_template", None):
        chat = chat_for(tokenizer, cfg.data, "data.chat_template")
    generation_eos = generation_eos_ids(cfg.model.policy) if cfg.model.policy else ()
    return stop_token_ids(tokenizer, chat, cfg.generation.stop_token_ids, generation_eos)


# Names classification heads go by in transformers (Llama/GPT-2/Mistral: score;
# BERT-likes: classifier). A head missing from a checkpoint must fail loudly
# (OpenRLHF #209/#428: renamed heads were silently re-initialised).
HEAD_NAMES = ("score", "classifier", "v_head", "value_head")
