"""A local stub HTTP server for reward and judge tests (not a test module).

`StubServer(answer, max_requests)` listens on 127.0.0.1 on an ephemeral port (port 0),
serves POSTs in a daemon thread with `answer(path, body, headers) -> (status, json)`,
records every request (path, body, headers) and stops by itself after `max_requests`
requests or when the `with` block ends, whichever comes first.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class StubServer:
    def __init__(self, answer, max_requests: int = 64):
        self.answer, self.max_requests = answer, max_requests
        self.requests: list[tuple[str, dict, dict]] = []
        self.lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                size = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(size) or b"{}")
                with stub.lock:
                    stub.requests.append((self.path, body, dict(self.headers)))
                    count = len(stub.requests)
                status, out = stub.answer(self.path, body, dict(self.headers))
                data = json.dumps(out).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up waiting (a timeout under test)
                if count >= stub.max_requests:  # bounded: stop serving after this one
                    threading.Thread(target=stub.server.shutdown, daemon=True).start()

            def log_message(self, *args):  # quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


def chat_reply(text: str) -> dict:
    """An OpenAI chat-completions answer whose message is `text`."""
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]}
