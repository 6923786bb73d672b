"""A local OpenAI-compatible HTTP server — a TEST DOUBLE for the LLM.

Serves ``POST /v1/chat/completions`` and ``POST /v1/responses`` on 127.0.0.1 (a
free port) from a background thread, with scripted replies: a queue of
``StubReply`` (status, JSON body, extra headers, latency) or a callable that
builds one from the request. Every request is recorded (method, path, headers,
JSON body) so tests can assert on what an adapter sent and count attempts.
Reply bodies are shaped like real vLLM / OpenAI JSON (see ``chat_completion`` and
``responses_reply``; the shapes follow vLLM 0.32's recorded answers).

Pure stdlib (``http.server``), no dependencies.
"""

from __future__ import annotations

import collections
import itertools
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

__all__ = [
    "RecordedRequest",
    "StubOpenAI",
    "StubReply",
    "chat_completion",
    "error_body",
    "responses_reply",
]

_ids = itertools.count(1)


@dataclass
class StubReply:
    status: int = 200
    body: Any = None  # JSON-serialisable; None → a default reply for the path
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0


@dataclass
class RecordedRequest:
    method: str
    path: str
    headers: dict[str, str]  # lower-cased names
    body: Any


def chat_completion(
    content: str | None = "Hello!",
    *,
    tool_calls: list[dict[str, Any]] | None = None,
    reasoning: str | None = None,
    reasoning_field: str = "reasoning",
    finish_reason: str | None = None,
    prompt_tokens: int = 12,
    completion_tokens: int = 5,
    model: str = "tiny",
) -> dict[str, Any]:
    """A ``chat.completion`` body shaped like vLLM's (``tool_calls`` as (name, args) dicts)."""
    calls = None
    if tool_calls:
        calls = [
            {
                "id": tc.get("id") or f"chatcmpl-tool-{next(_ids):016x}",
                "type": "function",
                "function": {
                    "name": tc["name"],
                    "arguments": tc["arguments"]
                    if isinstance(tc["arguments"], str)
                    else json.dumps(tc["arguments"]),
                },
            }
            for tc in tool_calls
        ]
    message: dict[str, Any] = {
        "role": "assistant",
        "content": content,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": None,
    }
    if calls is not None:
        message["tool_calls"] = calls
    if reasoning is not None:
        message[reasoning_field] = reasoning
    return {
        "id": f"chatcmpl-{next(_ids):016x}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": finish_reason or ("tool_calls" if calls else "stop"),
                "stop_reason": None,
                "token_ids": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": "stub",
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        },
        "prompt_logprobs": None,
        "prompt_token_ids": None,
    }


def responses_reply(
    output: list[dict[str, Any]] | None = None,
    *,
    status: str = "completed",
    incomplete_details: dict[str, Any] | None = None,
    input_tokens: int = 20,
    output_tokens: int = 7,
    model: str = "gpt-stub",
) -> dict[str, Any]:
    """A ``response`` body shaped like the OpenAI Responses API's."""
    if output is None:
        output = [
            {
                "id": f"msg_{next(_ids):016x}",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Hello!", "annotations": [], "logprobs": []}],
            }
        ]
    return {
        "id": f"resp_{next(_ids):016x}",
        "object": "response",
        "created_at": time.time(),
        "status": status,
        "error": None,
        "incomplete_details": incomplete_details,
        "model": model,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": {
            "input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens,
        },
    }


def error_body(status: int, message: str = "error") -> dict[str, Any]:
    """An error body shaped like vLLM's (``{"error": {message, type, param, code}}``)."""
    kinds = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
             429: "RateLimitError", 503: "ServiceUnavailableError"}
    return {"error": {"message": message, "type": kinds.get(status, "APIError"),
                      "param": None, "code": status}}


Handler = Callable[[RecordedRequest], StubReply]


class StubOpenAI:
    """The stub server. Use as a context manager; ``base_url`` ends in ``/v1``.

    Replies come from ``enqueue``d ``StubReply`` objects in order; when the queue
    is empty, from ``handler`` if set, else a default 200 reply for the path.
    """

    def __init__(self, handler: Handler | None = None) -> None:
        self.handler = handler
        self.requests: list[RecordedRequest] = []
        self._queue: collections.deque[StubReply] = collections.deque()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ control

    def enqueue(self, *replies: StubReply | dict[str, Any]) -> None:
        with self._lock:
            for r in replies:
                self._queue.append(r if isinstance(r, StubReply) else StubReply(body=r))

    @property
    def port(self) -> int:
        assert self._server is not None, "stub not started"
        return self._server.server_address[1]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> StubOpenAI:
        stub = self

        class _Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
                return None

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(raw) if raw else None
                except json.JSONDecodeError:
                    body = raw.decode("utf-8", "replace")
                req = RecordedRequest(
                    method="POST",
                    path=self.path,
                    headers={k.lower(): v for k, v in self.headers.items()},
                    body=body,
                )
                with stub._lock:
                    stub.requests.append(req)
                    queued = stub._queue.popleft() if stub._queue else None
                reply = queued or (stub.handler(req) if stub.handler else StubReply())
                if reply.delay_s > 0 and stub._stopping.wait(reply.delay_s):
                    return
                self._send(reply, req)

            def do_GET(self) -> None:
                if self.path.rstrip("/") == "/v1/models":
                    self._send(StubReply(body={"object": "list", "data": [
                        {"id": "tiny", "object": "model", "owned_by": "stub"}]}), None)
                else:
                    self._send(StubReply(status=404, body=error_body(404, "not found")), None)

            def _send(self, reply: StubReply, req: RecordedRequest | None) -> None:
                body = reply.body
                if body is None:
                    if req is not None and req.path.endswith("/responses"):
                        body = responses_reply()
                    elif reply.status >= 400:
                        body = error_body(reply.status)
                    else:
                        body = chat_completion()
                data = json.dumps(body).encode()
                try:
                    self.send_response(reply.status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    for k, v in reply.headers.items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout tests)

        server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        server.daemon_threads = True
        server.block_on_close = False
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.02}, name="stub-openai", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> StubOpenAI:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ------------------------------------------------------------------ queries

    def paths(self) -> list[str]:
        with self._lock:
            return [r.path for r in self.requests]
