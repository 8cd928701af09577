"""A scripted stand-in for an LLM server, speaking OpenAI's chat-completions protocol over HTTP.

No language model runs on this machine (no GPU, no weights, no network), so the `llm` reviser's
tests talk to this real HTTP server (Python's threaded `http.server` on a free port) instead.
It answers `POST /v1/chat/completions` from a script: canned answers in order, or a function
of the request, so that each failure an endpoint can show (malformed JSON, answers that break
the schema, unknown ids, a slow answer, 5xx, 429 with Retry-After, refusals) is reproduced
exactly, over a real socket, through the reviser's real httpx client.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Reply:
    """One scripted HTTP answer."""

    status: int = 200
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0
    """Seconds to wait before answering (a slow model)."""


def chat(content: Any, prompt_tokens: int = 100, completion_tokens: int = 20,
         finish_reason: str = "stop", refusal: str | None = None, model: str = "scripted") -> Reply:
    """A chat completion whose message content is `content` (JSON-encoded unless a str)."""
    text = content if isinstance(content, str) else json.dumps(content)
    message: dict[str, Any] = {"role": "assistant", "content": None if refusal else text}
    if refusal:
        message["refusal"] = refusal
    return Reply(body={
        "id": "chatcmpl-1", "object": "chat.completion", "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    })


Script = list[Reply] | Callable[[dict[str, Any]], Reply]


class ScriptedLLM:
    """The server: `url` is the base URL to configure (up to /v1); `requests` what it got."""

    def __init__(self, script: Script):
        self.script = script
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as real servers do
            disable_nagle_algorithm = True  # headers and body leave at once (no 40 ms stalls)

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                length = int(self.headers.get("content-length", 0))
                raw = self.rfile.read(length)
                if self.path != "/v1/chat/completions":
                    self._send(Reply(404, {"error": {"message": f"no route {self.path}"}}))
                    return
                body = json.loads(raw)
                with server._lock:
                    server.requests.append(body)
                    server.headers.append({k.lower(): v for k, v in self.headers.items()})
                    if callable(server.script):
                        reply = server.script(body)
                    elif server.script:
                        reply = server.script.pop(0)
                    else:
                        reply = Reply(500, {"error": {"message": "script exhausted"}})
                time.sleep(reply.delay)
                self._send(reply)

            def _send(self, reply: Reply) -> None:
                data = json.dumps(reply.body).encode() if not isinstance(reply.body, bytes) \
                    else reply.body
                try:
                    self.send_response(reply.status)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(data)))
                    for k, v in reply.headers.items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up waiting (a timeout test)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/v1"

    def __enter__(self) -> ScriptedLLM:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def serve_forever(self) -> None:
        """Run until interrupted, printing the base URL first (for a benchmark's subprocess)."""
        print(self.url, flush=True)
        self._server.serve_forever(poll_interval=0.05)

    def situation(self, index: int = -1) -> dict[str, Any]:
        """The situation (the user message's JSON) of a request."""
        return json.loads(self.requests[index]["messages"][1]["content"])
