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
from rlhf_dist.planning.memory import ModelShape
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
    if stage != "ppo":
        return Shapes(policy)
    reward = read_shape(m.reward, "model.reward", trust) if m.reward else None
    teacher = read_shape(m.teacher, "model.teacher", trust) if m.teacher else None
    return Shapes(policy, reward, teacher)
