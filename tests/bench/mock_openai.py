"""A zero-latency OpenAI-compatible Responses server — a TEST DOUBLE for the LLM, for benchmarks.

``tests/stub_openai.py`` is the faithful one (vLLM's exact JSON, fault
injection, a stdlib threaded server at ~1 ms of CPU per request); this one is
built to cost as little as possible so that a benchmark measures *our*
processes: a bare asyncio protocol on keep-alive connections, one canned answer
per turn. ``POST .../responses`` answers a ``function_call`` to the first tool
offered when the request holds no ``function_call_output`` yet, else (and when
no tool is offered) an assistant message. Anything else is 404. ``--text`` and
``--args`` fix the message text and the tool call's arguments (e.g. an answer a
grader parses, arguments a server's tool validates).

    python tests/bench/mock_openai.py [--port N] [--text T] [--args JSON]   # prints "listening PORT"
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys

_ids = itertools.count(1)
_USAGE = {
    "input_tokens": 40,
    "output_tokens": 12,
    "total_tokens": 52,
    "input_tokens_details": {"cached_tokens": 0},
    "output_tokens_details": {"reasoning_tokens": 0},
}


def first_tool(body: bytes) -> str | None:
    """The name of the first function tool the request offers (Responses or chat form), if any."""
    if b'"tools"' not in body:
        return None
    for tool in json.loads(body).get("tools") or []:
        if tool.get("type") == "function":
            return str(tool.get("name") or tool.get("function", {}).get("name"))
    return None


def answer(body: bytes, text: str = "It is cold there.", args: str = '{"city": "San Francisco"}') -> bytes:
    """The Responses JSON for one request body (a call to the first tool offered, then a message)."""
    n = next(_ids)
    name = None if b'"function_call_output"' in body else first_tool(body)
    if name is None:
        item = {
            "type": "message",
            "id": f"msg_{n}",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }
    else:
        item = {
            "type": "function_call",
            "id": f"fc_{n}",
            "call_id": f"call_{n}",
            "name": name,
            "arguments": args,
            "status": "completed",
        }
    return json.dumps(
        {
            "id": f"resp_{n}",
            "object": "response",
            "created_at": 1700000000,
            "model": "mock",
            "status": "completed",
            "output": [item],
            "parallel_tool_calls": True,  # the OpenAI SDK's Response requires these three (NeMo Gym validates it)
            "tool_choice": "auto",
            "tools": [],
            "usage": _USAGE,
        }
    ).encode()


class _HTTP(asyncio.Protocol):
    """HTTP/1.1 with keep-alive and Content-Length bodies (what httpx sends); no chunked uploads."""

    text = "It is cold there."
    args = '{"city": "San Francisco"}'

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.t: asyncio.Transport = transport  # type: ignore[assignment]
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end]
            length = 0
            for line in head.split(b"\r\n")[1:]:
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4 : end + 4 + length]
            self.buf = self.buf[end + 4 + length :]
            path = head.split(b" ", 2)[1]
            if path.endswith(b"/responses"):
                status, out = b"200 OK", answer(body, self.text, self.args)
            else:
                status, out = b"404 Not Found", b'{"error": {"message": "not found"}}'
            self.t.write(
                b"HTTP/1.1 "
                + status
                + b"\r\ncontent-type: application/json\r\ncontent-length: "
                + str(len(out)).encode()
                + b"\r\n\r\n"
                + out
            )


async def serve(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_HTTP, "127.0.0.1", port, backlog=1024)
    print(f"listening {server.sockets[0].getsockname()[1]}", flush=True)
    await server.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--text", default=_HTTP.text, help="the assistant message's text")
    ap.add_argument("--args", default=_HTTP.args, help="the tool call's arguments (a JSON object)")
    args = ap.parse_args()
    _HTTP.text, _HTTP.args = args.text, args.args
    try:
        asyncio.run(serve(args.port))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
