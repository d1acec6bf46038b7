"""A local stub HTTP server for reward, judge and hub tests (not a test module).

`StubServer(answer, max_requests)` listens on 127.0.0.1 on an ephemeral port (port 0),
serves POSTs in a daemon thread with `answer(path, body, headers) -> (status, json or bytes)`,
records every request (path, body, headers) and stops by itself after `max_requests`
requests or when the `with` block ends, whichever comes first. With `keep_alive` it
speaks HTTP/1.1 and keeps connections open between requests; `ports` records the client
port of every request (one port for several requests: one connection reused).
"""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class StubServer:
    def __init__(self, answer, max_requests: int = 64, keep_alive: bool = False):
        self.answer, self.max_requests = answer, max_requests
        self.requests: list[tuple[str, dict, dict]] = []
        self.ports: list[int] = []
        self.lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1" if keep_alive else "HTTP/1.0"

            def do_POST(self):
                size = int(self.headers.get("Content-Length", 0))
                body = parse_body(self.rfile.read(size), self.headers.get("Content-Type", ""))
                with stub.lock:
                    stub.requests.append((self.path, body, dict(self.headers)))
                    stub.ports.append(self.client_address[1])
                    count = len(stub.requests)
                status, out = stub.answer(self.path, body, dict(self.headers))
                data = out if isinstance(out, bytes) else json.dumps(out).encode()  # bytes: raw
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


def parse_body(raw: bytes, content_type: str):
    """A request's JSON body; newline-delimited JSON (the hub's commit call) as a list."""
    if content_type.startswith("application/x-ndjson"):
        return [json.loads(line) for line in raw.splitlines() if line.strip()]
    return json.loads(raw or b"{}")


def hub_answer(path: str, body, headers: dict) -> tuple[int, dict]:
    """A stand-in for the few Hugging Face Hub endpoints `HfApi.create_repo` and
    `upload_folder` call (huggingface_hub's endpoint documentation): create a repository,
    ask how each file is uploaded (always "regular": inlined, base64, in the commit) and
    commit. `committed_files(stub.requests)` reads back what was uploaded."""
    if path == "/api/repos/create":
        repo = "/".join(filter(None, (body.get("organization"), body["name"])))
        host = headers.get("Host") or headers.get("host")  # RepoUrl checks it is the endpoint
        return 200, {"url": f"http://{host}/{repo}", "name": repo}
    if "/preupload/" in path:
        files = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                 for f in body["files"]]  # fmt: skip
        return 200, {"files": files}
    if "/commit/" in path:
        host, oid = headers.get("Host") or headers.get("host"), "0" * 40
        repo = path.split("/api/models/", 1)[1].split("/commit/", 1)[0]
        return 200, {"commitUrl": f"http://{host}/{repo}/commit/{oid}", "commitOid": oid,
                     "pullRequestUrl": None}  # fmt: skip
    if path == "/api/validate-yaml":
        return 200, {"errors": [], "warnings": []}
    return 404, {"error": f"the stand-in does not serve {path}"}


def committed_files(requests) -> dict[str, dict[str, bytes]]:
    """{repository: {path in the repository: bytes}} of every commit the stand-in received."""
    repos: dict[str, dict[str, bytes]] = {}
    for path, body, _ in requests:
        if "/commit/" not in path:
            continue
        repo = path.split("/api/models/", 1)[1].split("/commit/", 1)[0]
        for line in body:
            if line["key"] == "file":
                value = line["value"]
                repos.setdefault(repo, {})[value["path"]] = base64.b64decode(value["content"])
    return repos


def chat_reply(text: str) -> dict:
    """An OpenAI chat-completions answer whose message is `text`."""
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]}
