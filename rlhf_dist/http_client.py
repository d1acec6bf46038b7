"""The package's one HTTP transport (httpx): JSON in, JSON out, for the rollout servers'
client (generation/server.py), the episodes behind the chat endpoint (rollout/endpoint.py)
and the remote rewards and judges (rewards/remote.py). Each caller words its own errors
and keeps its own retry rules; this module only moves bytes.

One `JSONClient` keeps a pool of open connections (keep-alive: a call to a server it
reached before skips the TCP handshake) and may be shared between threads (httpx's
`Client` is documented so): the rollout shards, the endpoint's episodes and the requests
in flight under ppo.max_staleness all draw from it. Every phase of a call is bounded by
the one timeout: connecting, sending, each read of the answer, and waiting for a free
connection when `max_connections` calls are already in flight (httpx's pool timeout).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import httpx


class HTTPFailure(Exception):
    """One call that got no usable answer. `status`: the HTTP status of an error answer
    (its text holds "HTTP <status> <the answer's first characters>"), None when no answer
    came (network, timeout: the text is the reason) or it was not JSON."""

    def __init__(self, text: str, status: int | None = None) -> None:
        super().__init__(text)
        self.status = status


class JSONClient:
    """Pooled JSON calls with one timeout (seconds) on every phase of each."""

    def __init__(self, timeout_s: float, max_connections: int = 64) -> None:
        self.timeout_s = timeout_s
        self.client = httpx.Client(
            timeout=httpx.Timeout(timeout_s),
            limits=httpx.Limits(
                max_connections=max_connections, max_keepalive_connections=max_connections
            ),
        )

    def call(
        self, url: str, body: Any = None, headers: Mapping[str, str] | None = None,
        detail_chars: int = 300,
    ) -> Any:  # fmt: skip
        """The parsed JSON answer of a GET (`body` None) or a POST of `body` as JSON;
        HTTPFailure otherwise (an error answer's first `detail_chars` characters kept)."""
        sent = {"Content-Type": "application/json", **(headers or {})}
        try:
            if body is None:
                answer = self.client.get(url, headers=sent)
            else:
                answer = self.client.post(url, content=json.dumps(body), headers=sent)
        except httpx.TimeoutException:
            raise HTTPFailure("timed out") from None
        except (httpx.TransportError, OSError) as e:  # refused, reset, unreachable
            raise HTTPFailure(_reason(e)) from None
        if answer.status_code >= 400:
            detail = answer.text[:detail_chars].strip()
            raise HTTPFailure(f"HTTP {answer.status_code} {detail}", answer.status_code)
        try:
            return json.loads(answer.content)
        except ValueError:
            raise HTTPFailure("the answer is not JSON") from None

    def close(self) -> None:
        """Close the pooled connections; the client makes no call after it."""
        self.client.close()


def _reason(error: Exception) -> str:
    """The reason of a failed connection, as the socket words it ("[Errno 111] Connection
    refused"), else the exception's name."""
    cause: BaseException | None = error
    while cause is not None and not str(cause):
        cause = cause.__cause__ or cause.__context__
    return str(cause) if cause is not None else type(error).__name__
