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
        )  # fmt: skip
    except (AttributeError, TypeError) as e:
        raise ConfigError(f"{key}: {path!r} is not a decoder-only transformer config ({e})") from e


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
