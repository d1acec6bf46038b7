"""The architecture numbers of a run's models, from their config.json alone (no weights):
`transformers.AutoConfig.from_pretrained` on a local directory (or a hub name, cached)
reads one small file, so a 70B model is planned in seconds. launch/configs/shapes/ ships
the shapes of Llama-3-8B, Llama-3-70B, Qwen2.5-7B and Qwen2.5-72B for planning offline.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rlhf_dist.config import Config
from rlhf_dist.errors import ConfigError
from rlhf_dist.planning.memory import ModelShape, VisionShape
from rlhf_dist.planning.plan import Shapes


def read_shape(path: str, key: str, trust_remote_code: bool = False) -> ModelShape:
    """The ModelShape of the model at `path` (config key `key`, named in errors): a local
    config.json with Llama-style names is read as JSON (no transformers import: instant);
    anything else through AutoConfig, which knows every architecture's names."""
    local = Path(path) / "config.json"
    if local.is_file():
        data = json.loads(local.read_text())
        if set(data) >= LLAMA_STYLE_KEYS and "text_config" not in data:
            return _shape_of(SimpleNamespace(**data), path, key)
    from transformers import AutoConfig

    try:
        c = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}: cannot read the model's config.json at {path!r} ({e})") from e
    return _shape_of(getattr(c, "text_config", None) or c, path, key)  # multimodal: its LM


LLAMA_STYLE_KEYS = {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "model_type"}  # fmt: skip


def _shape_of(c: Any, path: str, key: str) -> ModelShape:
    """The ModelShape of a config object `c` (AutoConfig's, or config.json's keys as
    attributes); a ConfigError naming `key` when it is not a decoder-only transformer's."""
    try:
        heads = int(c.num_attention_heads)
        hidden = int(c.hidden_size)
        head_dim = int(getattr(c, "head_dim", None) or hidden // heads)
        inter = getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * hidden
        return ModelShape(
            vocab=int(c.vocab_size), hidden=hidden, layers=int(c.num_hidden_layers),
            heads=heads, kv_heads=int(getattr(c, "num_key_value_heads", None) or heads),
            head_dim=head_dim, intermediate=int(inter),
            tied=bool(getattr(c, "tie_word_embeddings", False)),
            qkv_bias=bool(getattr(c, "attention_bias", False)) or c.model_type.startswith("qwen2"),
            **expert_numbers(c, int(inter)),
        )  # fmt: skip
    except (AttributeError, TypeError) as e:
        raise ConfigError(f"{key}: {path!r} is not a decoder-only transformer config ({e})") from e


# config.json names of the routed experts (Qwen-MoE and OLMoE, Mixtral and gpt-oss,
# DeepSeek), of their MLP width, of the experts per token, and of the shared experts
EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts")
EXPERT_WIDTH = ("moe_intermediate_size",)
PER_TOKEN = ("num_experts_per_tok",)


def _first(c: Any, names: tuple[str, ...], default: int = 0) -> int:
    return int(next((getattr(c, n) for n in names if getattr(c, n, None)), default))


def expert_numbers(c: Any, intermediate: int) -> dict[str, int]:
    """ModelShape's mixture-of-experts fields of config `c` ({} for a dense model): the
    sparse layers are all but DeepSeek's first_k_dense_replace and Qwen's mlp_only_layers
    (every decoder_sparse_step-th otherwise); experts without a width of their own (Mixtral,
    gpt-oss) have the dense `intermediate`; shared experts: Qwen2-MoE's
    shared_expert_intermediate_size, DeepSeek's n_shared_experts x the expert width."""
    experts = _first(c, EXPERTS)
    if experts <= 1:
        return {}
    width = _first(c, EXPERT_WIDTH, intermediate)
    shared = int(getattr(c, "shared_expert_intermediate_size", 0) or 0)
    shared += int(getattr(c, "n_shared_experts", 0) or 0) * width
    layers = int(c.num_hidden_layers)
    dense = set(range(int(getattr(c, "first_k_dense_replace", 0) or 0)))
    dense |= set(getattr(c, "mlp_only_layers", None) or ())
    step = int(getattr(c, "decoder_sparse_step", 1) or 1)
    sparse = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
    return {
        "experts": experts, "experts_per_token": _first(c, PER_TOKEN, 1),
        "expert_intermediate": width, "shared_intermediate": shared, "moe_layers": len(sparse),
    }  # fmt: skip


def read_shapes(cfg: Config, stage: str) -> Shapes:
    """The shapes of the models `stage` loads: the policy (RM: the reward model, or the
    policy it starts from), PPO's reward model (also the critic's start) and teacher."""
    m, trust = cfg.model, cfg.model.trust_remote_code
    if stage == "rm":
        path, key = (m.reward, "model.reward") if m.reward else (m.policy, "model.policy")
        if not path:
            raise ConfigError("model.reward: required (the model to train as reward model)")
        return Shapes(read_shape(path, key, trust))
    if not m.policy:
        raise ConfigError("model.policy: required (the model whose memory is planned)")
    policy = read_shape(m.policy, "model.policy", trust)
    vision = read_vision(m.policy, trust, cfg.data.max_image_tokens)
    if stage != "ppo":
        return Shapes(policy, vision=vision)
    reward = read_shape(m.reward, "model.reward", trust) if m.reward else None
    teacher = read_shape(m.teacher, "model.teacher", trust) if m.teacher else None
    return Shapes(policy, reward, teacher, vision)


def read_vision(
    path: str, trust_remote_code: bool, max_image_tokens: int = 0
) -> VisionShape | None:
    """The VisionShape of the model at `path` when its config.json has a `vision_config`
    (a vision-language model), else None. max_image_tokens: data.max_image_tokens (0: the
    family's own count, `_image_tokens`)."""
    local = Path(path) / "config.json"
    if local.is_file() and "vision_config" not in json.loads(local.read_text()):
        return None
    from transformers import AutoConfig

    try:
        c = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return None  # read_shape reported it
    if getattr(c, "vision_config", None) is None:
        return None
    return vision_shape(c, path, max_image_tokens)


# vision towers whose patch embedding has a bias (SigLIP's, Idefics3's, Qwen3-VL's)
CONV_BIAS = ("siglip_vision_model", "idefics3_vision", "smolvlm_vision", "qwen3_vl_vision")


def vision_shape(c: Any, path: str, max_image_tokens: int = 0) -> VisionShape:
    """The vision tower and projector of config `c` in transformers 5.19's layouts: a
    CLIP / SigLIP / Idefics3 ViT (hidden_size, num_hidden_layers, num_attention_heads) or
    Qwen-VL's (embed_dim or hidden_size, depth, num_heads; `spatial_merge_size`); what is
    not a ViT config is a ConfigError naming model.policy."""
    v, lm = c.vision_config, c.text_config.hidden_size
    try:
        merge = int(getattr(v, "spatial_merge_size", 0) or 0)
        h = int(getattr(v, "embed_dim", None) or v.hidden_size) if merge else int(v.hidden_size)
        f = int(getattr(v, "intermediate_size", None) or h * v.mlp_ratio)
        layers = int(getattr(v, "num_hidden_layers", None) or v.depth)
        heads = int(getattr(v, "num_attention_heads", None) or v.num_heads)
        patch = int(v.patch_size)
    except (AttributeError, TypeError) as e:
        raise ConfigError(f"model.policy: {path!r}: unknown vision tower config ({e})") from e
    gated = c.model_type == "qwen2_5_vl"  # SwiGLU blocks; the others fc1 / fc2
    channels = int(_first(v, ("num_channels", "in_channels", "in_chans"), 3))
    bias = h if v.model_type in CONV_BIAS else 0  # CLIP's and Qwen's patch convs have none
    embed = channels * int(getattr(v, "temporal_patch_size", 1) or 1) * patch * patch * h + bias
    # q, k, v, o with biases; SwiGLU (gate, up, down) with biases and two RMSNorms, or fc1,
    # fc2 and two LayerNorms
    per_layer = 4 * h * h + 4 * h + (3 * h * f + 2 * f + 3 * h if gated else 2 * h * f + f + 5 * h)
    tokens, positions, extra = _image_numbers(c, v, h, lm, patch, merge, path, max_image_tokens)
    params = embed + layers * per_layer + extra
    return VisionShape(params, h, layers, heads, f, tokens, positions, gated)


def _image_numbers(
    c: Any, v: Any, h: int, lm: int, patch: int, merge: int, path: str, asked: int
) -> tuple[int, int, int]:
    """(language-model tokens per image, tower positions per image, parameters besides
    the patch embedding and the layers: position embeddings, the final norms, the
    projector) of each family. Qwen2-VL / 2.5-VL / 3-VL: `asked` tokens, else the
    processor's max_pixels, 4 positions per token, the merger (LayerNorm, then an MLP of
    h m^2 -> h m^2 -> lm); LLaVA: the patches (CLS too with the `full` strategy), CLIP's
    CLS and pre-norm, a 2-layer projector; Gemma 3: mm_tokens_per_image from the pooled
    patches, one projection; Idefics3 / SmolVLM: one tile's patches / scale_factor^2 (or
    `asked` tokens over whole tiles), one projection of h x scale^2."""
    if merge:
        m2 = merge * merge
        tokens = asked or _qwen_max_tokens(path, patch, merge)
        mlp = (h * m2) ** 2 + h * m2 + h * m2 * lm + lm
        merger = mlp + (h if c.model_type == "qwen2_5_vl" else 2 * h)  # RMSNorm, LayerNorm
        learned = int(getattr(v, "num_position_embeddings", 0) or 0) * h
        # Qwen3-VL's deepstack mergers normalise the merged h m^2 features
        deep = len(getattr(v, "deepstack_visual_indexes", None) or ()) * (mlp + 2 * h * m2)
        return tokens, tokens * m2, merger + learned + deep
    patches = (int(v.image_size) // patch) ** 2
    if c.model_type == "gemma3":
        tokens = asked or int(c.mm_tokens_per_image)
        return tokens, patches, patches * h + 2 * h + h * lm + h + _siglip_head(v, h)
    if c.model_type in ("idefics3", "smolvlm"):
        per_tile = patches // int(c.scale_factor) ** 2
        tiles = -(-asked // per_tile) if asked else 1
        return (
            tiles * per_tile,
            tiles * patches,
            patches * h + 2 * h + h * int(c.scale_factor) ** 2 * lm,
        )
    clip = v.model_type == "clip_vision_model"
    full = getattr(c, "vision_feature_select_strategy", "default") == "full"  # CLS kept
    tokens = asked or patches + (clip and full)
    layers = getattr(c, "vision_feature_layer", -1)
    width = h * (len(layers) if isinstance(layers, (list, tuple)) else 1)
    projector = width * lm + lm + lm * lm + lm
    embeds = (patches + clip) * h + clip * h  # positions (+ CLS) and CLIP's class embedding
    return tokens, patches + clip, embeds + (4 if clip else 2) * h + projector


def _siglip_head(v: Any, h: int) -> int:
    """SigLIP's attention-pooling head when the config keeps it (vision_use_head, on when
    unset): a probe, one attention (4h^2 + 4h), a LayerNorm and an fc1 / fc2 MLP."""
    if not getattr(v, "vision_use_head", True):
        return 0
    f = int(v.intermediate_size)
    return h + 4 * h * h + 4 * h + 2 * h + 2 * h * f + f + h


def _qwen_max_tokens(path: str, patch: int, merge: int) -> int:
    """Qwen-VL tokens of the largest image its processor makes: max_pixels (or
    size.longest_edge, transformers 5's name) of the saved preprocessor_config.json over
    the pixels of one merged token; none saved is a ConfigError asking for the key."""
    pixels = 0
    for name in ("preprocessor_config.json", "processor_config.json"):
        local = Path(path) / name
        data = json.loads(local.read_text()) if local.is_file() else {}
        data = data.get("image_processor", data)  # processor_config.json nests it
        found = data.get("max_pixels") or (data.get("size") or {}).get("longest_edge")
        pixels = pixels or int(found or 0)
    if not pixels:
        raise ConfigError(
            "data.max_image_tokens: set it to plan a Qwen-VL policy (its image tokens depend on "
            f"the image size, and {path!r} saves no processor max_pixels)"
        )
    return max(1, int(pixels) // (patch * merge) ** 2)
