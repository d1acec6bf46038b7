"""A small client for HTTP rewards: a remote reward model (`reward.url`) and an
OpenAI-compatible chat-completions judge (`reward.judge_url`). docs/rewards.md holds the
protocols.

HTTP through rlhf_dist/http_client.py (httpx: one pool of connections per client, shared
by the judge's threads). Every request goes through retry.call_with_retries (the loop
reward.function uses: reward.retries, reward.retry_delay_s); every phase of it times out
after reward.timeout_s (60 s when that is null: an HTTP call never waits for ever). The API
key is read from the environment variable that reward.api_key_env names, sent as
`Authorization: Bearer <key>`, and never logged: config.yaml holds only the variable's
name, and every message this module makes has the key replaced by "***".
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from rlhf_dist.config import RewardConfig
from rlhf_dist.errors import ConfigError
from rlhf_dist.http_client import HTTPFailure, JSONClient
from rlhf_dist.rewards.retry import call_with_retries

if TYPE_CHECKING:  # judge imports torch; this module does not
    from rlhf_dist.rewards.judge import Prompt

DEFAULT_TIMEOUT_S = 60.0


class RemoteError(Exception):
    """One HTTP request that failed (status, network, unreadable answer); retried."""


class HTTPClient:
    """POSTs JSON to URLs with the run's key, timeout and retries."""

    def __init__(self, reward_cfg: RewardConfig, label: str):
        r = reward_cfg
        self.label = label  # the config key named in messages, e.g. "reward.url"
        self.timeout_s = r.timeout_s or DEFAULT_TIMEOUT_S
        self.retries, self.retry_delay_s = r.retries, r.retry_delay_s
        self._key = api_key(r.api_key_env)
        # a connection for each of the judge's threads (remote_batch_size) at least
        self.http = JSONClient(self.timeout_s, max_connections=max(16, r.remote_batch_size))

    def redact(self, text: str) -> str:
        return text.replace(self._key, "***") if self._key else text

    def post(self, url: str, body: dict) -> dict:
        """The JSON answer to one POST, tried again on failure (retry.call_with_retries)."""
        return call_with_retries(
            lambda: self._post_once(url, body), self.label, self.retries, self.retry_delay_s
        )

    def _post_once(self, url: str, body: dict) -> dict:
        headers = {"Authorization": f"Bearer {self._key}"} if self._key else {}
        try:
            out = self.http.call(url, body, headers, detail_chars=200)
        except HTTPFailure as e:  # the status and detail, or the reason, or "not JSON"
            raise RemoteError(self.redact(f"POST {url}: {e}")) from None
        if not isinstance(out, dict):
            raise RemoteError(f"POST {url}: expected a JSON object, got {type(out).__name__}")
        return out


def api_key(env_name: str) -> str:
    """The key in environment variable `env_name` ("" when no variable is named)."""
    if not env_name:
        return ""
    value = os.environ.get(env_name, "")
    if not value:
        raise ConfigError(f"reward.api_key_env: environment variable {env_name} is not set")
    return value


class RemoteReward:
    """`(prompts, responses) -> list[float]` from a remote reward model (reward.url):
    POST {"prompts": [...], "responses": [...]} -> {"scores": [...]}, at most
    reward.remote_batch_size responses per request, with "columns": {name: [...]} (the
    rows' other columns, JSON values) when the data has any. Prompts go as given (texts
    or message lists). The answer's count and values are checked by RewardFunction."""

    def __init__(self, reward_cfg: RewardConfig):
        self.url, self.batch_size = reward_cfg.url, reward_cfg.remote_batch_size
        self.client = HTTPClient(reward_cfg, "reward.url")
        self.__name__ = "remote"

    def __call__(
        self, prompts: Sequence[Prompt], responses: Sequence[str], **columns: Sequence[Any]
    ) -> list:
        scores = []
        for i in range(0, len(responses), self.batch_size):
            part = slice(i, i + self.batch_size)
            body: dict[str, Any] = {
                "prompts": list(prompts[part]),
                "responses": list(responses[part]),
            }
            if columns:
                body["columns"] = {name: list(v[part]) for name, v in columns.items()}
            answer = self.client.post(self.url, body)
            if not isinstance(answer.get("scores"), list):
                raise RemoteError(f"POST {self.url}: the answer has no 'scores' list")
            scores += answer["scores"]
        return scores


class ChatJudgeClient:
    """Judge replies from an OpenAI-compatible server: one chat-completions request per
    judge prompt (greedy: temperature 0), reward.remote_batch_size of them at a time."""

    def __init__(self, reward_cfg: RewardConfig):
        r = reward_cfg
        self.url = r.judge_url.rstrip("/") + "/chat/completions"
        self.model, self.max_tokens = r.judge_model_name, r.judge_max_new_tokens
        self.workers = r.remote_batch_size
        self.client = HTTPClient(reward_cfg, "reward.judge_url")

    def replies(self, texts: list[str]) -> list[str]:
        """One reply per text, in order; the requests run on remote_batch_size threads."""
        with ThreadPoolExecutor(max_workers=max(1, min(self.workers, len(texts)))) as pool:
            return list(pool.map(self._reply, texts))

    def _reply(self, text: str) -> str:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": text}],
            "temperature": 0.0,
            "max_tokens": self.max_tokens,
        }
        answer = self.client.post(self.url, body)
        try:
            content = answer["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise RemoteError(f"POST {self.url}: no choices[0].message.content") from None
        return content if isinstance(content, str) else ""
