"""`rlhf-dist serve --config ...`: load model.policy and serve it over HTTP until stopped
(docs/serving.md). The token comes from the environment variable serve.token_env; it is
never printed, logged or written."""

from __future__ import annotations

import os

import torch

from rlhf_dist.config import Config
from rlhf_dist.data.chat import chat_for
from rlhf_dist.errors import ConfigError
from rlhf_dist.generation.vllm import VLLMEngine
from rlhf_dist.models.loading import load_causal_lm, policy_stop_ids, tokenizer_for, train_dtype
from rlhf_dist.models.vision import policy_vision
from rlhf_dist.serving.app import build_app
from rlhf_dist.serving.policy import ServedPolicy


def server_token(cfg: Config) -> str:
    """The shared token, or a ConfigError naming the key when the variable is unset."""
    name = cfg.serve.token_env
    token = os.environ.get(name, "") if name else ""
    if not token:
        raise ConfigError(
            f"serve.token_env: set the environment variable {name or '(none named)'} to a "
            "shared secret; the server does not run without one"
        )
    return token


def load_policy(cfg: Config) -> ServedPolicy:
    """model.policy in model.dtype, on the GPU where there is one, ready to serve."""
    if not cfg.model.policy:
        raise ConfigError("model.policy: required (the causal LM to serve)")
    if cfg.perf.num_threads:
        torch.set_num_threads(cfg.perf.num_threads)
    tokenizer = tokenizer_for(cfg, "policy")
    model = load_causal_lm(cfg.model.policy, "model.policy", train_dtype(cfg.model))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    engine = None
    if cfg.serve.engine == "vllm":  # the model stays on the CPU: the updates' staging copy
        engine = VLLMEngine(cfg, device)
    else:
        model.to(device)
    stops = policy_stop_ids(cfg, tokenizer)
    timeout = float(cfg.distributed.timeout_s)
    chat = None  # /v1/chat/completions renders with data.chat_template or the tokenizer's own
    if cfg.data.chat_template or getattr(tokenizer, "chat_template", None):
        chat = chat_for(tokenizer, cfg.data, "data.chat_template")
    vision = policy_vision(cfg)  # a vision-language model's processor: requests with images
    return ServedPolicy(
        model, tokenizer, stops, cfg.perf, cfg.model.policy, timeout, chat, engine, vision
    )


def serve(cfg: Config) -> None:
    """Serve until interrupted (uvicorn handles SIGINT / SIGTERM)."""
    import uvicorn

    token = server_token(cfg)  # before the model loads: a missing token is instant
    policy = load_policy(cfg)
    s = cfg.serve
    app = build_app(
        policy, token, s.max_batch, s.max_new_tokens, s.tool_call_parser, s.batch_window_ms
    )
    print(f"rlhf-dist serve: {cfg.model.policy} on http://{s.host}:{s.port}", flush=True)
    uvicorn.run(app, host=s.host, port=s.port, log_level="warning")
