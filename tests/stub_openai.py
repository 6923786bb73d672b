"""A local OpenAI-compatible HTTP server — a TEST DOUBLE for the LLM (and for vLLM).

Serves 127.0.0.1 (a free port) from a background thread. Replies come from, in
order: a queue of scripted ``StubReply`` objects (status, JSON body, headers,
latency; optionally only for one path, e.g. to fail ``/tokenize``), a
``handler(request)`` callable, else the built-in **vLLM 0.32 emulator**
(``VLLMEmulator``): field for field the JSON of the real request/response pairs
in ``tests/compat/vllm/`` —

* ``POST /v1/chat/completions``: the chat template of the recorded tiny model
  (``tool_chat_template.jinja``, ported to Python) rendered and tokenized with a
  byte-level BPE rebuilt from the recordings (it reproduces every token-id list
  recorded there exactly); ``return_token_ids`` → ``prompt_token_ids`` and
  ``choices[].token_ids``; ``logprobs`` + ``return_tokens_as_token_ids`` →
  ``token_id:N`` logprob tokens; Hermes tool-call parsing; ``tool_choice``
  named/required; an optional reasoning parser (``reasoning`` field).
* ``POST /v1/completions`` with a text or token-id prompt (vLLM's legacy
  logprobs block, ``choices[].prompt_token_ids``), ``/tokenize`` (prompt or
  messages + tools, ``add_generation_prompt``, ``return_token_strs``),
  ``/detokenize``, ``GET /v1/models``, ``/version``, ``/health``.
* vLLM's errors with their exact bodies: context length (400), a prompt of
  exactly the context → ``max_tokens must be at least 1, got 0`` (400),
  ``tools: []`` (400), ``tool_choice`` without tools (400), a missing
  ``messages`` (400), an unknown model (404); prompt + ``max_tokens`` over the
  context is capped, not an error.

What the emulated model "samples" is scripted (``emulator.script(...)``, or a
``policy(body) -> Gen``); it emits the text byte by byte (one token per byte,
then the end token), as the recorded random-weight model mostly did, so the chat
template's canonical re-tokenization of a previous assistant turn differs from
what was generated — the non-contiguity measured on the real server.

Fault injection: ``enqueue(StubReply(status=429|503|400, delay_s=..., path=...))``
or ``fail(status, times, path)``; ``latency_s`` delays every reply. Every request
is recorded (method, path, headers, JSON body).

With a ``handler`` the stub is a generic OpenAI double, not vLLM: it answers every GET 404 (no
``/v1/models`` list, so a model worker's start-up check of the model name passes whatever it is called).

Pure stdlib, no dependencies. ``python tests/stub_openai.py --port N`` serves
the emulator standalone (benchmarks).
"""

from __future__ import annotations

import collections
import functools
import itertools
import json
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = [
    "Gen",
    "RecordedRequest",
    "StubOpenAI",
    "StubReply",
    "TinyTokenizer",
    "VLLMEmulator",
    "chat_completion",
    "error_body",
    "render_chat",
    "responses_reply",
]

_ids = itertools.count(1)


@dataclass
class StubReply:
    status: int = 200
    body: Any = None  # JSON-serialisable; None → a default reply for the path
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0
    path: str | None = None  # only for requests whose path contains this (None: any POST)


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
                    "arguments": tc["arguments"] if isinstance(tc["arguments"], str) else json.dumps(tc["arguments"]),
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


def error_body(
    status: int, message: str = "error", *, param: str | None = None, type: str | None = None
) -> dict[str, Any]:
    """An error body shaped like vLLM's (``{"error": {message, type, param, code}}``)."""
    kinds = {
        400: "BadRequestError",
        401: "AuthenticationError",
        404: "NotFoundError",
        429: "RateLimitError",
        503: "ServiceUnavailableError",
    }
    return {
        "error": {"message": message, "type": type or kinds.get(status, "APIError"), "param": param, "code": status}
    }


# ============================================================ the tiny tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte ↔ printable-unicode table (byte-level BPE)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_B2U = _bytes_to_unicode()
_U2B = {u: b for b, u in _B2U.items()}

# Merged tokens of the recorded tiny model (id → text), read off tests/compat/vllm
# (token_strs, logprob bytes, detokenized prompts); ids are BPE merge ranks.
_MERGES: dict[int, str] = {
    261: "he",
    263: " t",
    264: "er",
    266: "is",
    268: "re",
    270: " re",
    272: "an",
    273: "ar",
    274: "as",
    275: "at",
    276: "az",
    277: "all",
    280: "call",
    283: "hat",
    286: "ld",
    288: "lus",
    294: "ool",
    296: "qu",
    298: "st",
    299: "su",
    300: "sy",
    304: "tool",
    305: "ur",
    307: "what",
    308: " wo",
    310: " is",
    311: " as",
    313: " call",
    315: " ju",
    320: " sy",
    322: " the",
    324: "user",
    326: " rewar",
    328: "own",
    329: "stem",
    330: "sistan",
    332: " fox",
    334: " brown",
    344: " assistant",
    # Implied by token counts only (ids 262, 269, 271, 278, 279 made up):
    262: "Be",
    267: "ll",
    302: "the",
    269: "ef",
    271: " two",
    278: " plus",
    279: "hello",
}
_PRETOKEN = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+""")


class TinyTokenizer:
    """The recorded tiny model's byte-level BPE: ids 0-4 special (3 ``<|im_start|>``,
    4 ``<|im_end|>``), 5-260 the 256 byte symbols in code-point order, then merges."""

    SPECIAL = {"<|endoftext|>": 0, "<|pad|>": 1, "<|unk|>": 2, "<|im_start|>": 3, "<|im_end|>": 4}
    EOS = 4
    _SPECIAL_RE = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL) + ")")

    def __init__(self) -> None:
        self.id_to_bytes: dict[int, bytes] = {}
        for i, sym in enumerate(sorted(_B2U.values())):
            self.id_to_bytes[5 + i] = bytes([_U2B[sym]])
        for i, text in _MERGES.items():
            self.id_to_bytes[i] = text.encode()
        self.bytes_to_id = {b: i for i, b in self.id_to_bytes.items()}
        self.byte_ids = [self.bytes_to_id[bytes([b])] for b in range(256)]
        self.special_by_id = {i: s for s, i in self.SPECIAL.items()}
        self.vocab_size = max(self.id_to_bytes) + 1

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one tokenizer per process
    def _bpe(self, word: bytes) -> tuple[int, ...]:
        pieces = [bytes([c]) for c in word]
        while len(pieces) > 1:
            best: tuple[int, bytes] | None = None
            for i in range(len(pieces)):
                s = pieces[i]
                for j in range(i + 1, len(pieces)):
                    s += pieces[j]
                    t = self.bytes_to_id.get(s)
                    if t is not None and t >= 261 and (best is None or t < best[0]):
                        best = (t, s)
            if best is None:
                break
            target = best[1]
            out: list[bytes] = []
            k = 0
            while k < len(pieces):
                s, m, found = b"", k, False
                while m < len(pieces) and len(s) < len(target):
                    s += pieces[m]
                    m += 1
                    if s == target and m - k >= 2:
                        found = True
                        break
                if found:
                    out.append(target)
                    k = m
                else:
                    out.append(pieces[k])
                    k += 1
            pieces = out
        return tuple(self.bytes_to_id[p] for p in pieces)

    def encode(self, text: str) -> list[int]:
        return list(self._encode(text))

    @functools.lru_cache(maxsize=4096)  # noqa: B019 - prompts repeat (benchmarks, retries)
    def _encode(self, text: str) -> tuple[int, ...]:
        ids: list[int] = []
        for part in self._SPECIAL_RE.split(text):
            if not part:
                continue
            special = self.SPECIAL.get(part)
            if special is not None:
                ids.append(special)
                continue
            for m in _PRETOKEN.finditer(part):
                ids.extend(self._bpe(m.group().encode()))
        return tuple(ids)

    def encode_bytewise(self, text: str) -> list[int]:
        """One token per byte: how the emulated model 'samples' a text."""
        return [self.byte_ids[b] for b in text.encode()]

    def token_bytes(self, i: int) -> bytes:
        special = self.special_by_id.get(i)
        return special.encode() if special is not None else self.id_to_bytes.get(i, b"")

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        out = b"".join(b"" if skip_special_tokens and i in self.special_by_id else self.token_bytes(i) for i in ids)
        return out.decode("utf-8", "replace")

    def token_str(self, i: int) -> str:
        """The token as the tokenizer's vocabulary spells it (``Ġ`` for a space, ...)."""
        special = self.special_by_id.get(i)
        return special if special is not None else "".join(_B2U[b] for b in self.id_to_bytes.get(i, b""))


# ======================================================= the recorded chat template


def _content_text(content: Any) -> str:
    """vLLM joins a message's text parts with newlines before the template sees them."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")


def _template_tool(tool: dict[str, Any]) -> dict[str, Any]:
    fn = dict(tool.get("function") or {})
    shaped = {
        "name": fn.pop("name", None),
        "description": fn.pop("description", None),
        "parameters": fn.pop("parameters", None),
        **fn,
    }
    return {"type": tool.get("type", "function"), "function": shaped}


def _tojson(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            value = json.loads(raw)
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}
    return raw if raw is not None else {}


def render_chat(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, *, add_generation_prompt: bool = True
) -> str:
    """``tool_chat_template.jinja`` (tests/compat/vllm) with vLLM's preprocessing, in Python."""
    out: list[str] = []
    start = 1 if messages and messages[0].get("role") in ("system", "developer") else 0
    if tools:
        out.append("<|im_start|>system\n")
        if start:
            out.append(_content_text(messages[0].get("content")) + "\n\n")
        out.append("# Tools\n\nFunction signatures are inside <tools></tools>:\n<tools>")
        for tool in tools:
            out.append("\n" + _tojson(_template_tool(tool)))
        out.append(
            "\n</tools>\n\nTo call a function, answer with a JSON object inside <tool_call></tool_call>:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        )
    elif start:
        out.append("<|im_start|>system\n" + _content_text(messages[0].get("content")) + "<|im_end|>\n")
    rest = messages[start:]
    for k, m in enumerate(rest):
        role = m.get("role")
        if role == "assistant":
            out.append("<|im_start|>assistant\n")
            out.append(_content_text(m.get("content")))
            for tc in m.get("tool_calls") or []:
                f = tc.get("function", tc)
                out.append(
                    '<tool_call>\n{"name": "'
                    + str(f.get("name"))
                    + '", "arguments": '
                    + _tojson(_arguments(f.get("arguments")))
                    + "}\n</tool_call>"
                )
            out.append("<|im_end|>\n")
        elif role == "tool":
            if k == 0 or rest[k - 1].get("role") != "tool":
                out.append("<|im_start|>user")
            out.append("\n<tool_response>\n" + _content_text(m.get("content")) + "\n</tool_response>")
            if k == len(rest) - 1 or rest[k + 1].get("role") != "tool":
                out.append("<|im_end|>\n")
        else:
            out.append(f"<|im_start|>{role}\n" + _content_text(m.get("content")) + "<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


# ================================================================ the emulator


@dataclass
class Gen:
    """What the emulated model samples: ``text`` (emitted one token per byte, then the end
    token), or exact ``token_ids``. Logprobs are deterministic per (token, position)."""

    text: str = "OK"
    token_ids: list[int] | None = None
    stop: bool = True  # end with the end token (else: as if cut by a stop string)


class _HTTPError(Exception):
    def __init__(self, status: int, body: dict[str, Any]) -> None:
        self.status = status
        self.body = body


def _validation_error(loc: str, given: dict[str, Any]) -> _HTTPError:
    msg = (
        f"1 validation error:\n  {{'type': 'missing', 'loc': '{loc}', 'msg': 'Field required', "
        f"'input': '<dict of {len(given)} items>'}}"
    )
    return _HTTPError(400, error_body(400, msg, param=loc, type="Bad Request"))


def _bad_request(message: str, param: str | None) -> _HTTPError:
    return _HTTPError(400, error_body(400, message, param=param))


_HERMES_RE = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(?!.*</tool_call>)(.*)", re.DOTALL)
_THINK_RE = re.compile(r"<think>(.*?)</think>", re.DOTALL)


class VLLMEmulator:
    """vLLM 0.32's OpenAI server as recorded, over ``TinyTokenizer`` and ``render_chat``."""

    def __init__(
        self,
        *,
        model: str = "tiny",
        max_model_len: int = 1024,
        reasoning_parser: bool = False,
        fingerprint: str = "vllm-0.32.0-59e96f14",
    ) -> None:
        self.model = model
        self.max_model_len = max_model_len
        self.reasoning_parser = reasoning_parser  # split <think> into message.reasoning
        self.fingerprint = fingerprint
        self.tokenizer = TinyTokenizer()
        self.policy: Callable[[str, dict[str, Any]], Gen] | None = None
        self._script: collections.deque[Gen] = collections.deque()
        self._lock = threading.Lock()
        # Streaming (``stream: true`` on /v1/completions): one token every ``token_delay_s``, each with the
        # logprob of the ``weights`` current when it is sampled (a trainer's weight update is ``weights += 1``).
        self.token_delay_s = 0.0
        self.weights = 0
        self.streamed = 0  # tokens sent in streams
        self.streams_cut = 0  # streams whose client closed the connection before the end
        self.progress = threading.Condition()  # notified per streamed token and per cut stream
        # A stream that reaches token ``hold_at`` waits there for ``released`` (once: the next stream does not),
        # so a test acts on a stream it knows is midway, however loaded the machine is.
        self.hold_at: int | None = None
        self.released = threading.Event()

    # ------------------------------------------------------------------ scripting

    def script(self, *gens: Gen | str) -> None:
        """Queue what the next generations sample (a str is ``Gen(text=...)``)."""
        with self._lock:
            self._script.extend(g if isinstance(g, Gen) else Gen(text=g) for g in gens)

    def _next_gen(self, path: str, body: dict[str, Any]) -> Gen:
        with self._lock:
            if self._script:
                return self._script.popleft()
        if self.policy is not None:
            return self.policy(path, body)
        return Gen()

    @staticmethod
    def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
        """The Hermes text a model emits to call a tool."""
        return '<tool_call>\n{"name": "' + name + '", "arguments": ' + json.dumps(arguments) + "}\n</tool_call>"

    # ------------------------------------------------------------------ dispatch

    def handle(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        route = path.split("?", 1)[0].rstrip("/")
        try:
            if method == "GET":
                if route == "/v1/models":
                    return 200, self._models()
                if route == "/version":
                    return 200, {"version": "0.32.0"}
                if route in ("/health", "/ping"):
                    return 200, None
                return 404, {"detail": "Not Found"}
            if not isinstance(body, dict):
                raise _HTTPError(400, error_body(400, "the request body must be a JSON object", type="Bad Request"))
            if route == "/v1/chat/completions":
                return 200, self._chat(body)
            if route == "/v1/completions":
                return 200, self._completions(body)
            if route == "/tokenize":
                return 200, self._tokenize(body)
            if route == "/detokenize":
                return 200, self._detokenize(body)
            if route == "/v1/responses":
                return 200, responses_reply()
            return 404, {"detail": "Not Found"}
        except _HTTPError as e:
            return e.status, e.body

    def _models(self) -> dict[str, Any]:
        now = int(time.time())
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model,
                    "object": "model",
                    "created": now,
                    "owned_by": "vllm",
                    "root": "tinyllm-tools",
                    "parent": None,
                    "max_model_len": self.max_model_len,
                    "permission": [
                        {
                            "id": f"modelperm-{uuid.uuid4().hex[:16]}",
                            "object": "model_permission",
                            "created": now,
                            "allow_create_engine": False,
                            "allow_sampling": True,
                            "allow_logprobs": True,
                            "allow_search_indices": False,
                            "allow_view": True,
                            "allow_fine_tuning": False,
                            "organization": "*",
                            "group": None,
                            "is_blocking": False,
                        }
                    ],
                }
            ],
        }

    def _check_model(self, body: dict[str, Any]) -> None:
        name = body.get("model")
        if name is not None and name != self.model:
            raise _HTTPError(
                404, error_body(404, f"The model `{name}` does not exist. Valid aliases: {self.model}.", param="model")
            )

    def _check_tools(self, body: dict[str, Any]) -> list[dict[str, Any]] | None:
        tools = body.get("tools")
        if tools is not None:
            if not tools:
                raise _bad_request(
                    "`tools` must not be an empty array. Either provide at least one tool or "
                    "omit the field entirely. (parameter=tools)",
                    "tools",
                )
            for i, t in enumerate(tools):
                if not isinstance(t, dict) or not isinstance(t.get("function"), dict):
                    raise _validation_error(f"body.tools.{i}.function", t if isinstance(t, dict) else {})
        elif body.get("tool_choice") not in (None, "none"):
            raise _bad_request("When using `tool_choice`, `tools` must be set. (parameter=tool_choice)", "tool_choice")
        return tools

    def _room(self, prompt_len: int, body: dict[str, Any]) -> int:
        """vLLM's checks of prompt length and ``max_tokens``: the capped max_tokens."""
        if prompt_len > self.max_model_len:
            n = self.max_model_len + 1
            raise _bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt "
                f"contains at least {n} input tokens, which exceeds this limit even without any output tokens. "
                f"Please reduce the length of the input prompt. (parameter=input_tokens, value={n})",
                "input_tokens",
            )
        room = self.max_model_len - prompt_len
        asked = body.get("max_tokens", body.get("max_completion_tokens"))
        max_tokens = room if asked is None else min(int(asked), room)
        if max_tokens < 1:
            raise _bad_request(
                f"max_tokens must be at least 1, got {max_tokens}. (parameter=max_tokens, value={max_tokens})",
                "max_tokens",
            )
        return max_tokens

    def _sample(self, path: str, body: dict[str, Any], max_tokens: int) -> tuple[list[int], str, str]:
        """(token ids, finish_reason, text without special tokens)."""
        gen = self._next_gen(path, body)
        tok = self.tokenizer
        ids = list(gen.token_ids) if gen.token_ids is not None else tok.encode_bytewise(gen.text)
        if gen.token_ids is None and gen.stop:
            ids.append(tok.EOS)
        if len(ids) > max_tokens:
            ids = ids[:max_tokens]
            finish = "length"
        else:
            finish = "stop"
        return ids, finish, tok.decode(ids, skip_special_tokens=True)

    @staticmethod
    def _logprob(token: int, pos: int, weights: int = 0) -> float:
        return -round(0.05 + ((token * 7919 + pos * 104729 + weights * 15485863) % 1000) / 250.0, 6)

    def wait_streamed(self, tokens: int, timeout: float = 60.0) -> bool:
        """Block until at least ``tokens`` tokens were streamed in all (a test waits on this, not a sleep)."""
        with self.progress:
            return self.progress.wait_for(lambda: self.streamed >= tokens, timeout)

    def stream_completions(self, body: dict[str, Any]) -> Any:
        """``/v1/completions`` with ``stream: true``: vLLM's chunks, one token each (``token_delay_s`` apart),
        the first carrying ``prompt_token_ids``; a generator the server writes as server-sent events."""
        if "prompt" not in body:
            raise _validation_error("body.prompt", body)
        self._check_model(body)
        raw = body["prompt"]
        if not (isinstance(raw, list) and all(isinstance(t, int) for t in raw)):
            raise _bad_request("this emulator streams token-id prompts only", "prompt")
        prompt = list(raw)
        max_tokens = self._room(len(prompt), body)
        ids, finish, _ = self._sample("/v1/completions", body, max_tokens)
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        want_ids = bool(body.get("return_token_ids"))
        cid, created = f"cmpl-{uuid.uuid4().hex[:16]}", int(time.time())

        def chunks() -> Any:
            for pos, t in enumerate(ids):
                if pos == self.hold_at:
                    self.hold_at = None
                    self.released.wait(60.0)
                if self.token_delay_s:
                    time.sleep(self.token_delay_s)
                lp = self._logprob(t, pos, self.weights)
                tok = f"token_id:{t}" if as_ids else self.tokenizer.token_bytes(t).decode("utf-8", "replace")
                text = "" if t == self.tokenizer.EOS else self.tokenizer.decode([t], skip_special_tokens=True)
                choice: dict[str, Any] = {
                    "index": 0,
                    "text": text,
                    "logprobs": {
                        "text_offset": [0],
                        "token_logprobs": [lp],
                        "tokens": [tok],
                        "top_logprobs": [{tok: lp}],
                    },
                    "finish_reason": finish if pos == len(ids) - 1 else None,
                    "stop_reason": None,
                    "token_ids": [t] if want_ids else None,
                }
                if pos == 0 and want_ids:
                    choice["prompt_token_ids"] = prompt
                yield {
                    "id": cid,
                    "object": "text_completion",
                    "created": created,
                    "model": self.model,
                    "choices": [choice],
                    "usage": None,
                }

        return chunks()

    def _token_entry(self, token: int, logprob: float, as_ids: bool) -> dict[str, Any]:
        raw = self.tokenizer.token_bytes(token)
        try:
            raw.decode("utf-8")
            shown = list(raw)
        except UnicodeDecodeError:
            shown = []
        text = f"token_id:{token}" if as_ids else raw.decode("utf-8", "replace")
        return {"token": text, "logprob": logprob, "bytes": shown}

    # ------------------------------------------------------------------ endpoints

    def _chat(self, body: dict[str, Any]) -> dict[str, Any]:
        if "messages" not in body:
            raise _validation_error("body.messages", body)
        self._check_model(body)
        tools = self._check_tools(body)
        tool_choice = body.get("tool_choice", "auto" if tools else "none")
        prompt = self.tokenizer.encode(
            render_chat(body["messages"], tools, add_generation_prompt=body.get("add_generation_prompt", True))
        )
        max_tokens = self._room(len(prompt), body)
        n = int(body.get("n") or 1)
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        want_logprobs = bool(body.get("logprobs"))
        top_n = int(body.get("top_logprobs") or 0)
        choices = []
        completion_tokens = 0
        for index in range(n):
            ids, finish, text = self._sample("/v1/chat/completions", body, max_tokens)
            completion_tokens += len(ids)
            message: dict[str, Any] = {
                "role": "assistant",
                "content": text,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
            }
            reasoning = None
            if self.reasoning_parser and "</think>" in text:
                head, _, tail = text.partition("</think>")
                reasoning = head.replace("<think>", "", 1)
                text = tail
                message["content"] = text
            calls: list[dict[str, Any]] = []
            if isinstance(tool_choice, dict):  # named: the output is the arguments JSON
                calls = [
                    {
                        "id": f"chatcmpl-tool-{uuid.uuid4().hex[:16]}",
                        "type": "function",
                        "function": {"name": tool_choice["function"]["name"], "arguments": text},
                    }
                ]
                message["content"] = ""
            elif tool_choice == "required":
                message["content"] = ""
                try:
                    for c in json.loads(text):
                        calls.append(
                            {
                                "id": f"chatcmpl-tool-{uuid.uuid4().hex[:16]}",
                                "type": "function",
                                "function": {"name": c["name"], "arguments": json.dumps(c["parameters"])},
                            }
                        )
                except (ValueError, TypeError, KeyError):
                    calls = []
            elif tools and tool_choice != "none" and "<tool_call>" in text:
                try:
                    for m in _HERMES_RE.finditer(text):
                        obj = json.loads((m.group(1) if m.group(1) is not None else m.group(2) or "").strip())
                        calls.append(
                            {
                                "id": f"chatcmpl-tool-{uuid.uuid4().hex[:16]}",
                                "type": "function",
                                "function": {
                                    "name": obj["name"],
                                    "arguments": json.dumps(obj.get("arguments", {}), ensure_ascii=False),
                                },
                            }
                        )
                    message["content"] = text[: text.index("<tool_call>")] or None
                    if finish == "stop":
                        finish = "tool_calls"
                except (ValueError, TypeError, KeyError):
                    calls = []
            if calls:
                message["tool_calls"] = calls
            message["reasoning"] = reasoning
            logprobs = None
            if want_logprobs:
                content = []
                for pos, t in enumerate(ids):
                    lp = self._logprob(t, pos)
                    entry = self._token_entry(t, lp, as_ids)
                    tops = []
                    for r in range(top_n):
                        alt = t if r == 0 else (t + 31 * r) % self.tokenizer.vocab_size
                        e = self._token_entry(alt, lp if r == 0 else lp - r, as_ids)
                        tops.append(e)
                    entry["top_logprobs"] = tops
                    content.append(entry)
                logprobs = {"content": content}
            choices.append(
                {
                    "index": index,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                    "stop_reason": None,
                    "token_ids": ids if body.get("return_token_ids") else None,
                    "routed_experts": None,
                }
            )
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:16]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": self.fingerprint,
            "usage": {
                "prompt_tokens": len(prompt),
                "total_tokens": len(prompt) + completion_tokens,
                "completion_tokens": completion_tokens,
                "prompt_tokens_details": None,
                "completion_tokens_details": None,
            },
            "prompt_logprobs": None,
            "prompt_token_ids": prompt if body.get("return_token_ids") else None,
            "prompt_text": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }

    def _completions(self, body: dict[str, Any]) -> dict[str, Any]:
        if "prompt" not in body:
            raise _validation_error("body.prompt", body)
        self._check_model(body)
        raw = body["prompt"]
        if isinstance(raw, list) and all(isinstance(t, int) for t in raw):
            prompt = list(raw)
        elif isinstance(raw, str):
            prompt = self.tokenizer.encode(raw)
        else:
            raise _bad_request("prompt must be a string or a list of token ids", "prompt")
        max_tokens = self._room(len(prompt), body)
        ids, finish, text = self._sample("/v1/completions", body, max_tokens)
        logprobs = None
        n_top = body.get("logprobs")
        if n_top is not None:
            as_ids = bool(body.get("return_tokens_as_token_ids"))
            tokens, lps, offsets, tops = [], [], [], []
            offset = 0
            for pos, t in enumerate(ids):
                lp = self._logprob(t, pos)
                s = f"token_id:{t}" if as_ids else self.tokenizer.token_bytes(t).decode("utf-8", "replace")
                tokens.append(s)
                lps.append(lp)
                offsets.append(offset)
                offset += len(s)
                tops.append({s: lp})
            logprobs = {"text_offset": offsets, "token_logprobs": lps, "tokens": tokens, "top_logprobs": tops}
        want_ids = bool(body.get("return_token_ids"))
        return {
            "id": f"cmpl-{uuid.uuid4().hex[:16]}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                    "stop_reason": None,
                    "token_ids": ids if want_ids else None,
                    "prompt_logprobs": None,
                    "prompt_token_ids": prompt if want_ids else None,
                    "routed_experts": None,
                }
            ],
            "service_tier": None,
            "system_fingerprint": self.fingerprint,
            "usage": {
                "prompt_tokens": len(prompt),
                "total_tokens": len(prompt) + len(ids),
                "completion_tokens": len(ids),
                "prompt_tokens_details": None,
                "completion_tokens_details": None,
            },
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }

    def _tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        self._check_model(body)
        if "messages" in body:
            tools = self._check_tools(body)
            text = render_chat(body["messages"], tools, add_generation_prompt=body.get("add_generation_prompt", True))
        elif "prompt" in body:
            text = body["prompt"]
        else:
            raise _validation_error("body.prompt", body)
        ids = self.tokenizer.encode(text)
        strs = [self.tokenizer.token_str(i) for i in ids] if body.get("return_token_strs") else None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}

    def _detokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        self._check_model(body)
        if "tokens" not in body:
            raise _validation_error("body.tokens", body)
        return {"prompt": self.tokenizer.decode(list(body["tokens"]))}


# ==================================================================== the server

Handler = Callable[[RecordedRequest], StubReply]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    request_queue_size = 2048  # listen backlog: hundreds of concurrent clients connect at once


def chat_chunks(completion: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat completion as the one ``chat.completion.chunk`` a streaming client reads (its message as the delta,
    tool calls indexed), usage and vLLM's token fields kept."""
    choice = completion["choices"][0]
    delta = dict(choice["message"])
    if delta.get("tool_calls"):
        delta["tool_calls"] = [{**c, "index": i} for i, c in enumerate(delta["tool_calls"])]
    chunk_choice = {k: v for k, v in choice.items() if k != "message"}
    return [{**completion, "object": "chat.completion.chunk", "choices": [{**chunk_choice, "delta": delta}]}]


class StubOpenAI:
    """The stub server. Use as a context manager; ``base_url`` ends in ``/v1``.

    Replies come from ``enqueue``d ``StubReply`` objects in order (the first whose
    ``path`` matches); else from ``handler`` if set; else from ``emulator``
    (a ``VLLMEmulator``). ``latency_s`` delays every reply.
    """

    def __init__(
        self,
        handler: Handler | None = None,
        *,
        emulator: VLLMEmulator | None = None,
        latency_s: float = 0.0,
        record: bool = True,
    ) -> None:
        self.handler = handler
        self.emulator = emulator or VLLMEmulator()
        self.latency_s = latency_s
        self.record = record
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

    def fail(
        self,
        status: int,
        times: int = 1,
        *,
        path: str | None = None,
        message: str | None = None,
        headers: dict[str, str] | None = None,
        delay_s: float = 0.0,
    ) -> None:
        """The next ``times`` requests (to ``path``, if given) get an error ``status``."""
        default = {429: "rate limited", 503: "Service Unavailable", 400: "bad request", 500: "internal error"}
        self.enqueue(
            *[
                StubReply(
                    status=status,
                    body=error_body(status, message or default.get(status, "error")),
                    headers=dict(headers or {}),
                    delay_s=delay_s,
                    path=path,
                )
                for _ in range(times)
            ]
        )

    def script(self, *gens: Gen | str) -> None:
        self.emulator.script(*gens)

    @property
    def port(self) -> int:
        assert self._server is not None, "stub not started"
        return self._server.server_address[1]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _take(self, path: str) -> StubReply | None:
        with self._lock:
            for i, r in enumerate(self._queue):
                if r.path is None or r.path in path:
                    del self._queue[i]
                    return r
        return None

    def start(self, port: int = 0) -> StubOpenAI:
        stub = self

        class _Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
                return None

            def setup(self) -> None:
                super().setup()
                # headers and body are two writes: without this, Nagle + delayed ACK add 40 ms
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def _serve(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(raw) if raw else None
                except json.JSONDecodeError:
                    body = raw.decode("utf-8", "replace")
                req = RecordedRequest(
                    method=method,
                    path=self.path,
                    headers={k.lower(): v for k, v in self.headers.items()},
                    body=body,
                )
                if stub.record:
                    with stub._lock:
                        stub.requests.append(req)
                reply = stub._take(self.path) if method == "POST" else None
                if reply is None and stub.handler is not None and method == "POST":
                    reply = stub.handler(req)
                elif reply is None and stub.handler is not None:  # a handler's double lists no models
                    reply = StubReply(status=404, body={"detail": "Not Found"})
                if (
                    reply is None
                    and method == "POST"
                    and isinstance(body, dict)
                    and body.get("stream")
                    and self.path.split("?", 1)[0].rstrip("/") == "/v1/completions"
                ):
                    try:
                        self._stream(stub.emulator.stream_completions(body))
                        return
                    except _HTTPError as e:
                        reply = StubReply(status=e.status, body=e.body)
                if (
                    reply is None
                    and method == "POST"
                    and isinstance(body, dict)
                    and body.get("stream")
                    and self.path.split("?", 1)[0].rstrip("/") == "/v1/chat/completions"
                ):
                    # a streaming chat client (verifiers 0.4's chat harness): the whole completion as one chunk
                    status, out = stub.emulator.handle(method, self.path, {**body, "stream": False})
                    if status == 200:
                        self._stream(chat_chunks(out))
                        return
                    reply = StubReply(status=status, body=out)
                if reply is None:
                    status, out = stub.emulator.handle(method, self.path, body)
                    reply = StubReply(status=status, body=out)
                    if out is None:
                        reply.body = ""
                delay = reply.delay_s + stub.latency_s
                if delay > 0 and stub._stopping.wait(delay):
                    return
                self._send(reply, req)

            def _stream(self, chunks: Any) -> None:
                """Server-sent events until ``[DONE]``, then close; a client that goes away cuts the stream."""
                emulator = stub.emulator
                self.close_connection = True
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.wfile.flush()
                    for chunk in chunks:
                        if stub._stopping.is_set():
                            return
                        self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                        self.wfile.flush()
                        with emulator.progress:
                            emulator.streamed += 1
                            emulator.progress.notify_all()
                    self.wfile.write(b"data: [DONE]\n\n")
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    with emulator.progress:
                        emulator.streams_cut += 1
                        emulator.progress.notify_all()

            def do_POST(self) -> None:
                self._serve("POST")

            def do_GET(self) -> None:
                self._serve("GET")

            def _send(self, reply: StubReply, req: RecordedRequest) -> None:
                body = reply.body
                if body is None:
                    if req.path.endswith("/responses"):
                        body = responses_reply()
                    elif reply.status >= 400:
                        body = error_body(reply.status)
                    else:
                        body = chat_completion()
                data = b"" if body == "" else json.dumps(body).encode()
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

        server = _Server(("127.0.0.1", port), _Handler)
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

    def bodies(self, path: str) -> list[Any]:
        """Bodies of the recorded requests whose path contains ``path``."""
        with self._lock:
            return [r.body for r in self.requests if path in r.path]


async def serve_async(
    emulator: VLLMEmulator,
    port: int = 0,
    *,
    latency_s: float = 0.0,
    ready: Callable[[int], None] | None = None,
    status: int | None = None,
) -> None:
    """The emulator behind a small asyncio HTTP/1.1 keep-alive server (benchmarks: no
    thread per connection). GET/POST with Content-Length bodies only. ``latency_s`` delays each
    generation (a POST), not a GET (a server that generates slowly still lists its models at once);
    ``status``: every POST is answered with it (a server that stays up and fails every call)."""
    import asyncio

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                length = 0
                for line in lines[1:]:
                    if line[:15].lower() == "content-length:":
                        length = int(line[15:])
                raw = await reader.readexactly(length) if length else b""
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = None
                code, out = emulator.handle(method, path, body)
                if method == "POST" and status is not None:
                    code, out = status, error_body(status, "Internal Server Error")
                if latency_s and method == "POST":
                    await asyncio.sleep(latency_s)
                data = b"" if out is None else json.dumps(out).encode()
                writer.write(
                    b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                    % (code, b"OK" if code < 400 else b"Error", len(data))
                    + data
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(client, "127.0.0.1", port, backlog=4096)
    if ready is not None:
        ready(server.sockets[0].getsockname()[1])
    async with server:
        await server.serve_forever()


def main() -> None:  # pragma: no cover - benchmark helper
    import argparse
    import asyncio

    ap = argparse.ArgumentParser(description="Serve the vLLM emulator (test double) on 127.0.0.1.")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--latency", type=float, default=0.0, help="seconds added to every generation (POST)")
    ap.add_argument("--status", type=int, default=None, help="answer every POST with this HTTP status")
    ap.add_argument("--text", default="Hello!", help="what every generation says")
    ap.add_argument("--threaded", action="store_true", help="the threaded server the tests use")
    args = ap.parse_args()
    em = VLLMEmulator()
    em.policy = lambda path, body: Gen(text=args.text)
    if args.threaded:
        stub = StubOpenAI(emulator=em, latency_s=args.latency, record=False).start(args.port)
        print(stub.base_url, flush=True)
        threading.Event().wait()
        return
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(
        serve_async(
            em,
            args.port,
            latency_s=args.latency,
            status=args.status,
            ready=lambda port: print(f"http://127.0.0.1:{port}/v1", flush=True),
        )
    )


if __name__ == "__main__":
    main()
