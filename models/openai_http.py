"""HTTP to OpenAI-compatible servers: endpoints, replica choice, retries, rate limits.

Shared by the ``openai`` and ``vllm`` adapters so that both fail the same way:

* **Retries are ours** (the OpenAI client runs with ``max_retries=0``): 408, 409,
  429 and 5xx answers, timeouts and connection errors are retried at most
  ``cfg.max_retries`` times with jittered exponential backoff (``Retry-After`` /
  ``retry-after-ms`` honoured); any other 4xx fails at once with
  ``retryable=False``. When every attempt fails the ``ModelError`` names the
  last failure, the endpoint and the number of attempts. ``cfg.timeout_s`` bounds
  each attempt (all HTTP calls of the attempt together).
* **Several base URLs** (``base_url: [a, b, ...]``): a rollout's calls (same
  ``rollout_key``) go to the endpoint its key ranks first by rendezvous hashing
  (``rendezvous``), for the prefix cache, while that endpoint is healthy, has a
  free slot and is within ``endpoint_load`` times the mean load (consistent
  hashing with bounded loads), else to the next in its ranking: every
  model-worker process in front of the same endpoints ranks them alike, so they
  agree without shared state. A call without a key goes to the least loaded
  healthy endpoint (fewest requests in flight). An endpoint that fails (connection error, timeout, 5xx) is
  skipped for a cooldown that doubles with each consecutive failure
  (``cfg.replica_cooldown_s``); a retry goes to another endpoint when there is
  one; when all are cooling down the least recently failed one is tried anyway.
* **Out of service, probed back in** (``EndpointPool.watch``): an endpoint with calls in flight that
  answers nothing for ``stall_s`` is asked ``GET /models``; no answer within ``PROBE_TIMEOUT_S`` (a server
  that accepts and never answers, a stopped process) takes it out of service: its calls in flight move to
  another endpoint at once (not after ``timeout_s``, which may be minutes for a long generation) and a probe
  every ``PROBE_EVERY_S`` brings it back when it answers. A slow generation on a server that answers probes
  (or streams) is never taken out. ``out_after`` failed calls in a row (5xx, timeouts, refused connections)
  take it out too; then one call is let through after a cooldown (doubling), and its success brings it back.
  Each change is one log line naming the URL. With every endpoint out a call fails at once (``AllOut``:
  which endpoints, which errors) instead of trying them again and again.
* **Rate-limit aware concurrency** per endpoint (``AdaptiveLimiter``): at most
  ``concurrency`` requests in flight (the worker's); a 429 halves that window and pauses new
  requests until the server's ``Retry-After``; successes grow it back by one per
  window (AIMD). OpenAI/Azure ``x-ratelimit-remaining-requests|tokens: 0`` pauses
  new requests until the matching ``x-ratelimit-reset-*`` before a 429 happens.

Requests to a self-hosted ``base_url`` (vLLM, any OpenAI-compatible server with
bearer auth) go through ``PlainHTTP``: the lean ``http1`` client for ``http://``,
a keep-alive ``aiohttp`` session for ``https://`` and proxies; hosted OpenAI and Azure through ``AsyncOpenAI.post(...,
cast_to=httpx2.Response)``. Either way the raw body is decoded with msgspec (no
pydantic on the hot path; vendor fields such as vLLM's token ids are kept) and
the headers are read for rate limits. Both paths fail with this module's
``HTTPStatusError`` / ``HTTPTimeout`` / ``HTTPUnreachable``, so the retry loop
classifies them alike, and the ``openai`` package (about half of a command's
imports, pydantic included) is imported only when a hosted endpoint needs its
client. The API key is scrubbed from every error message this module produces.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import math
import random
import re
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import aiohttp
import anyio
import msgspec

from gym_runtime.errors import ModelError
from gym_runtime.model import AdapterOptions
from gym_runtime.models import http1
from gym_runtime.observability import logs

if TYPE_CHECKING:
    import openai

log = logs.get("gym.models.transport")

T = TypeVar("T")

RETRY_STATUS = frozenset({408, 409, 429})
MAX_BACKOFF_S = 30.0
RETRY_LOG_S = 30.0  # one endpoint's retries are logged at most this often (with their count since)
PROBE_TIMEOUT_S = 10.0  # a start-up probe of an endpoint (``EndpointPool.probe``) waits at most this long
MAX_RETRY_AFTER_S = 60.0
MAX_COOLDOWN_S = 60.0
PROBE_EVERY_S = 5.0  # an endpoint out of service for silence is probed this often


class HTTPOptions(AdapterOptions, kw_only=True, forbid_unknown_fields=True):
    """The keys every HTTP adapter (``openai``, ``vllm``) reads. ``api_key`` and
    ``headers`` are secrets (never logged, printed or in a repr)."""

    secret_fields: ClassVar[tuple[str, ...]] = ("api_key", "headers")

    model: str | None = None  # the served model (overrides the request's)
    # One URL, or several replicas of one model (a rollout's calls to one replica by its key, bounded by load).
    base_url: str | list[str] | None = None
    api_key: str | None = None
    timeout_s: float = 120.0  # bounds each attempt
    max_retries: int = 3
    retry_backoff_s: float = 0.5
    replica_cooldown_s: float = 5.0  # a failing replica is skipped this long (doubling)
    headers: dict[str, str] = msgspec.field(default_factory=dict)  # extra HTTP headers
    extra_body: dict[str, Any] = msgspec.field(default_factory=dict)  # merged into every request body
    # a rollout keeps its replica while that one's calls in flight stay within this times the mean (and it has a
    # free slot): 1.0 spreads evenly and moves more rollouts, larger keeps more caches; 0: no affinity
    endpoint_load: float = 1.25
    # an endpoint with calls in flight that answers nothing this long is probed (GET /models), and taken out of
    # service when the probe is not answered either; 0: only ``timeout_s`` bounds a silent endpoint
    stall_s: float = 10.0
    out_after: int = 5  # failed calls in a row that take an endpoint out of service (probed back in)

    def __post_init__(self) -> None:
        if self.endpoint_load != 0 and self.endpoint_load < 1:
            raise ValueError(f"endpoint_load: {self.endpoint_load!r} must be 0 (off) or at least 1 (e.g. 1.25)")
        if self.stall_s < 0:
            raise ValueError(f"stall_s: {self.stall_s!r} must be 0 (off) or more seconds (e.g. 10)")
        if self.out_after < 1:
            raise ValueError(f"out_after: {self.out_after!r} must be at least 1 (e.g. 5)")

    def call_budget_s(self) -> float:
        return self.timeout_s * (self.max_retries + 1)


_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()


class ContextOverflow(Exception):
    """The server refused the request because the conversation no longer fits."""


class HTTPStatusError(Exception):
    """An endpoint answered an error status: what the retry loop classifies (``message`` as the
    OpenAI client words it, ``body`` the parsed error body, ``headers`` for ``Retry-After``)."""

    def __init__(self, message: str, *, status_code: int, body: Any, headers: Any) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.body = body
        self.headers = headers


def _status_error(status: int, content: bytes, headers: Any) -> HTTPStatusError:
    """An error status's body (JSON, else text) read as the OpenAI client words it: the error's ``message``."""
    try:
        err: Any = _decoder.decode(content)
    except msgspec.DecodeError:
        err = content.decode("utf-8", "replace")
    detail = err.get("error", err) if isinstance(err, dict) else err
    message = detail.get("message", detail) if isinstance(detail, dict) else detail
    return HTTPStatusError(f"Error code: {status} - {message}", status_code=status, body=err, headers=headers)


class HTTPTimeout(Exception):
    """An attempt's request timed out."""


class HTTPUnreachable(Exception):
    """The endpoint could not be reached or dropped the connection."""


class AllOut(ModelError):
    """Every endpoint of a model is out of service: calls fail at once, naming each endpoint and why."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=False, out_of_service=True)


def is_context_overflow(err: HTTPStatusError, body: dict[str, Any]) -> bool:
    """A 400 that means "the conversation no longer fits" (vLLM / OpenAI wording).

    vLLM: ``maximum context length is N tokens`` (prompt longer than the context),
    or ``max_tokens must be at least 1, got 0`` when the prompt fills the context
    exactly and vLLM's cap leaves no room (unless the caller asked for 0 itself).
    OpenAI: ``context_length_exceeded``.
    """
    if err.status_code != 400:
        return False
    text = f"{err.message} {err.body}".lower()
    if "context length" in text or "context_length_exceeded" in text:
        return True
    asked = body.get("max_tokens", body.get("max_output_tokens"))
    return "max_tokens must be at least 1" in text and not (isinstance(asked, int) and asked < 1)


async def post_object(ep: Endpoint, path: str, body: dict[str, Any], *, root: bool = False) -> dict[str, Any]:
    """POST and return the JSON object answered; a context overflow becomes ``ContextOverflow``."""
    try:
        data = await ep.post(path, body, root=root)
    except HTTPStatusError as e:
        if is_context_overflow(e, body):
            raise ContextOverflow(str(e.message)) from None
        raise
    if not isinstance(data, dict):
        raise ModelError(f"{ep.url}{path} answered with a non-JSON-object body", retryable=True)
    return data


_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str | None) -> float | None:
    """``"6m0s"`` / ``"1.5s"`` / ``"20ms"`` / ``"2"`` (seconds) → seconds."""
    if not text:
        return None
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    parts = _DURATION_RE.findall(text)
    if not parts:
        return None
    return sum(float(n) * _UNIT_S[u] for n, u in parts)


def retry_after(headers: Any) -> float | None:
    """Seconds the server asked us to wait (``retry-after-ms`` or ``retry-after``), capped."""
    try:
        ms = headers.get("retry-after-ms")
        if ms is not None:
            return min(float(ms) / 1000, MAX_RETRY_AFTER_S)
        value = headers.get("retry-after")
        return min(float(value), MAX_RETRY_AFTER_S) if value is not None else None
    except (TypeError, ValueError, AttributeError):
        return None


class AdaptiveLimiter:
    """Concurrency window for one endpoint: AIMD on 429s, pauses on rate-limit headers."""

    def __init__(self, ceiling: int) -> None:
        self.ceiling = max(1, ceiling)
        self.limit = float(self.ceiling)
        self.active = 0
        self.paused_until = 0.0
        self._waiters: collections.deque[anyio.Event] = collections.deque()

    @property
    def window(self) -> int:
        return max(1, int(self.limit))

    async def acquire(self) -> None:
        while True:
            wait = self.paused_until - time.monotonic()
            if wait > 0:
                await anyio.sleep(wait)
                continue
            if self.active < self.window:
                self.active += 1
                return
            ev = anyio.Event()
            self._waiters.append(ev)
            try:
                await ev.wait()
            except BaseException:
                if ev.is_set():  # woken and cancelled: pass the wake-up on
                    self._wake()
                else:
                    self._waiters.remove(ev)
                raise

    def _wake(self) -> None:
        while self._waiters and self.active < self.window:
            ev = self._waiters.popleft()
            if not ev.is_set():
                ev.set()
                return

    def release(self) -> None:
        self.active -= 1
        self._wake()

    def on_success(self) -> None:
        if self.limit < self.ceiling:
            self.limit = min(float(self.ceiling), self.limit + 1.0 / self.limit)

    def on_rate_limited(self, wait_s: float | None) -> None:
        self.limit = max(1.0, self.limit / 2)
        self.pause(wait_s if wait_s is not None else 1.0)

    def pause(self, wait_s: float) -> None:
        self.paused_until = max(self.paused_until, time.monotonic() + min(wait_s, MAX_RETRY_AFTER_S))


def env_proxy(url: str) -> str | None:
    """The ``HTTP(S)_PROXY`` that applies to ``url`` (``None`` when ``NO_PROXY`` exempts it), as
    httpx and the OpenAI client honour them. Read once per endpoint: aiohttp's ``trust_env``
    looks it up on a thread for every request."""
    import urllib.request
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.hostname and urllib.request.proxy_bypass(parts.hostname):
        return None
    return urllib.request.getproxies().get(parts.scheme)


class PlainHTTP:
    """An endpoint's plain-HTTP calls: ``http1.ConnectionPool`` for ``http://`` without a
    proxy, one keep-alive ``aiohttp`` session otherwise (TLS, proxies).

    Client CPU per call against a zero-latency server at 256 calls in flight: about
    30 µs through ``http1``, 130 µs through aiohttp, 2.1 ms through ``httpx`` and 4.0 ms
    through the OpenAI client. ``limit`` bounds the connections. Connection
    failures are raised as ``ConnectionError`` (``http1``) or ``aiohttp.ClientError``.
    """

    def __init__(self, url: str, *, limit: int, timeout_s: float) -> None:
        from urllib.parse import urlsplit

        self.limit = limit
        self.timeout_s = timeout_s
        self.proxy = env_proxy(url)
        parts = urlsplit(url)
        self._lean: http1.ConnectionPool | None = None
        if parts.scheme == "http" and not self.proxy and parts.hostname:
            self._origin = f"http://{parts.netloc}"
            self._lean = http1.ConnectionPool(parts.hostname, parts.port or 80, limit=limit)
        self._session: aiohttp.ClientSession | None = None
        self._headers: dict[str, str] | None = None  # the last headers seen, and their encoding
        self._encoded = b""

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.limit, limit_per_host=self.limit, keepalive_timeout=30.0),
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                proxy=self.proxy,
                skip_auto_headers=("User-Agent",),
            )
        return self._session

    async def post(self, url: str, data: bytes, headers: dict[str, str]) -> tuple[int, Any, bytes]:
        """POST ``data`` to ``url`` (under this endpoint): status, headers (``.get`` by lower-case name), body."""
        if self._lean is not None and url.startswith(self._origin):
            if headers is not self._headers:  # encoded once per endpoint, not per call
                self._encoded = http1.encode_headers(headers)
                self._headers = headers
            r = await self._lean.request("POST", url[len(self._origin) :] or "/", self._encoded, data)
            return r.status, r.headers, r.body
        async with self.session().post(url, data=data, headers=headers) as raw:
            return raw.status, raw.headers, await raw.read()

    async def get(self, url: str, headers: dict[str, str], *, timeout_s: float) -> tuple[int, bytes]:
        """GET ``url`` (a probe, not the hot path: aiohttp only): status and body."""
        async with self.session().get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)) as raw:
            return raw.status, await raw.read()

    async def aclose(self) -> None:
        if self._lean is not None:
            await self._lean.aclose()
        if self._session is not None and not self._session.closed:
            await self._session.close()


class Endpoint:
    """One base URL: its client, load and health.

    ``http`` (optional): a ``PlainHTTP`` session for OpenAI-compatible servers with
    bearer auth (vLLM, self-hosted ``base_url``): the same requests without the
    OpenAI client's per-call machinery (a fifteenth of its client CPU per call).
    ``client``: the OpenAI client of a hosted endpoint (OpenAI, Azure); ``None`` with ``http``.
    """

    def __init__(
        self,
        url: str,
        client: openai.AsyncOpenAI | None,
        concurrency: int,
        *,
        http: PlainHTTP | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        if client is None and http is None:
            raise ValueError(f"endpoint {url}: neither an OpenAI client nor plain HTTP")
        self.url = url.rstrip("/")
        self.http = http
        self._headers = {"Content-Type": "application/json", **(headers or {})}
        # vLLM serves /tokenize and /detokenize beside /v1, not under it.
        self.root = self.url[: -len("/v1")] if self.url.endswith("/v1") else self.url
        self.client = client
        self.limiter = AdaptiveLimiter(concurrency)
        self.in_flight = 0
        self.served = 0
        self.failures = 0
        self.down_until = 0.0
        self.heard = 0.0  # when it last answered anything (or its calls in flight began): ``EndpointPool.watch``
        self.out: str | None = None  # why it is out of service; None: in service
        self.silent = False  # out as it answered nothing (probed back by GET), else by errors (a trial call)
        self.back_at = 0.0  # when it is next probed (silent) or given one trial call (errors)
        self.trial = False  # its trial call is in flight
        self.trials_failed = 0
        self.probing = False
        self.attempts: set[anyio.CancelScope] = set()  # its calls in flight, cancelled when it is taken out

    def __repr__(self) -> str:
        return f"Endpoint({self.url!r}, in_flight={self.in_flight}, failures={self.failures})"

    def probe_headers(self) -> dict[str, str]:
        return {k: v for k, v in self._headers.items() if k != "Content-Type"}

    @property
    def healthy(self) -> bool:
        return self.out is None and self.down_until <= time.monotonic()

    def trial_due(self, now: float) -> bool:
        """Out for its errors, its cooldown over and no trial call in flight: one call may go to it."""
        return self.out is not None and not self.silent and not self.trial and now >= self.back_at

    def mark_failed(self, base_cooldown_s: float) -> None:
        self.failures += 1
        cooldown = min(base_cooldown_s * 2 ** (self.failures - 1), MAX_COOLDOWN_S)
        self.down_until = time.monotonic() + cooldown

    def mark_ok(self) -> None:
        self.failures = 0
        self.down_until = 0.0

    async def post(self, path: str, body: dict[str, Any], *, root: bool = False) -> Any:
        """POST ``body`` as JSON to ``path`` (under the base URL, or the server root)."""
        if self.http is not None:
            return await self._post_http(self.http, path, body, root=root)
        assert self.client is not None
        url = (self.root if root else self.url) + path
        raw = await _client_post(self.client, self.root + path if root else path, body)
        self._read_rate_headers(raw.headers)
        try:
            return _decoder.decode(raw.content)
        except msgspec.DecodeError:
            raise ModelError(f"{url} answered with a body that is not JSON", retryable=True) from None

    async def _post_http(self, http: PlainHTTP, path: str, body: dict[str, Any], *, root: bool) -> Any:
        url = (self.root if root else self.url) + path
        try:
            status, headers, content = await http.post(url, _encoder.encode(body), self._headers)
        except TimeoutError:
            raise HTTPTimeout(f"Request timed out: POST {url}") from None
        except (aiohttp.ClientError, OSError) as e:
            raise HTTPUnreachable(f"Connection error: {type(e).__name__}: {e}") from None
        self._read_rate_headers(headers)
        if status >= 400:
            raise _status_error(status, content, headers)
        try:
            return _decoder.decode(content)
        except msgspec.DecodeError:
            raise ModelError(f"{url} answered with a body that is not JSON", retryable=True) from None

    async def stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """POST ``body`` (``stream: true``) and yield each server-sent event's JSON object until ``[DONE]``.

        Leaving the loop early closes the connection: vLLM aborts a request whose client went away."""
        if self.http is None:
            raise ModelError(f"{self.url}: streaming needs a self-hosted base_url (plain HTTP)", retryable=False)
        url = self.url + path
        try:
            async with self.http.session().post(url, data=_encoder.encode(body), headers=self._headers) as raw:
                self._read_rate_headers(raw.headers)
                if raw.status >= 400:
                    raise _status_error(raw.status, await raw.read(), raw.headers)
                async for line in raw.content:
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        return
                    try:
                        event = _decoder.decode(data)
                    except msgspec.DecodeError:
                        raise ModelError(f"{url} streamed an event that is not JSON", retryable=True) from None
                    self.heard = time.monotonic()  # a generation streaming is alive, however long it runs
                    if isinstance(event, dict) and "error" in event and "choices" not in event:
                        raise ModelError(f"{url} streamed an error: {event['error']}"[:1000], retryable=True)
                    yield event
        except TimeoutError:
            raise HTTPTimeout(f"Request timed out: POST {url}") from None
        except (aiohttp.ClientError, OSError) as e:
            raise HTTPUnreachable(f"Connection error: {type(e).__name__}: {e}") from None

    def _read_rate_headers(self, headers: Any) -> None:
        for kind in ("requests", "tokens"):
            remaining = headers.get(f"x-ratelimit-remaining-{kind}")
            if remaining is not None and remaining.strip() in ("0", "0.0"):
                reset = parse_duration(headers.get(f"x-ratelimit-reset-{kind}"))
                if reset:
                    self.limiter.pause(reset)


async def _client_post(client: openai.AsyncOpenAI, path: str, body: dict[str, Any]) -> Any:
    """POST through the OpenAI client (relative paths take its URL logic: Azure deployments), its
    failures raised as this module's errors; the raw ``httpx`` response (no pydantic parsing)."""
    import httpx2
    import openai

    try:
        return await client.post(path, cast_to=httpx2.Response, body=body)
    except openai.APIStatusError as e:
        raise HTTPStatusError(e.message, status_code=e.status_code, body=e.body, headers=e.response.headers) from None
    except openai.APITimeoutError as e:  # before APIConnectionError: a subclass of it
        raise HTTPTimeout(str(e)) from None
    except openai.APIConnectionError as e:
        raise HTTPUnreachable(str(e)) from None


def rendezvous(key: str, urls: list[str]) -> list[int]:
    """The endpoints' indexes, best first, for ``key`` (highest random weight): each process ranks alike, and an
    endpoint added or removed moves only the keys it ranks first."""
    k = key.encode()
    return sorted(
        range(len(urls)),
        key=lambda i: hashlib.blake2b(k + b"\0" + urls[i].encode(), digest_size=8).digest(),
        reverse=True,
    )


def base_urls(cfg: HTTPOptions) -> list[str]:
    urls = cfg.base_url if isinstance(cfg.base_url, list) else [cfg.base_url] if cfg.base_url else []
    return [u for u in urls if u]


class EndpointPool:
    """The endpoints of one model, the replica policy and the retry loop."""

    def __init__(
        self,
        cfg: HTTPOptions,
        endpoints: list[Endpoint],
        *,
        secret: str | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("no endpoint to call")
        self.cfg = cfg
        self.endpoints = endpoints
        self._secret = secret if secret and secret != "EMPTY" else None
        self._rr = 0
        # calls with a rollout key by where they went: its first-ranked endpoint, or further down its ranking as
        # the first was over the load bound or full ("load"), or down/failed ("moved")
        self.routed = {"affine": 0, "load": 0, "moved": 0}
        self._retries_logged: dict[str, tuple[float, int]] = {}  # endpoint -> (last logged, retries since)
        self._watcher: asyncio.Task[None] | None = None  # ``watch``, while calls are in flight or endpoints out
        self._probes: set[asyncio.Task[None]] = set()

    def scrub(self, text: str) -> str:
        return text.replace(self._secret, "***") if self._secret else text

    def _log_retry(self, url: str, failure: str) -> None:
        """An endpoint that went away fails every call alike: say why once per ``RETRY_LOG_S``, with the
        number of retries since, not once per call."""
        now = time.monotonic()
        last, count = self._retries_logged.get(url, (-1e18, 0))
        if now - last < RETRY_LOG_S:
            self._retries_logged[url] = (last, count + 1)
            return
        self._retries_logged[url] = (now, 0)
        log.warning("model.retry", endpoint=url, error=failure, retries_since_last=count, every_s=RETRY_LOG_S)

    async def probe(self, model: str | None) -> str | None:
        """Why the self-hosted endpoints cannot serve ``model`` (one line naming the URL), or None.

        One ``GET {base_url}/models`` each (OpenAI-compatible servers, vLLM included, list what they serve):
        connection refused or timed out, credentials refused, or ``model`` not among those listed. An
        answer this cannot read (no ``/models`` route, another status) is not held against the endpoint.
        Hosted OpenAI and Azure endpoints are not probed (an account's models list is not the deployments)."""
        for ep in self.endpoints:
            if ep.http is None:
                continue
            url = f"{ep.url}/models"
            wait_s = min(self.cfg.timeout_s, PROBE_TIMEOUT_S)
            try:
                status, body = await ep.http.get(url, ep.probe_headers(), timeout_s=wait_s)
            except aiohttp.ClientConnectorError as e:
                return self.scrub(f"cannot connect to {ep.url}: {e.os_error.strerror or e}")
            except (aiohttp.ClientError, OSError) as e:
                return self.scrub(f"cannot connect to {ep.url}: {e}")
            except TimeoutError:
                return f"{ep.url} did not answer within {wait_s} s"
            if status in (401, 403):
                return f"{ep.url} refused the credentials (HTTP {status} on GET /models): check api_key"
            if status == 404:  # no API at this path: the usual slip is base_url without (or past) its /v1
                there = await self._api_at(ep, wait_s)
                if there is not None:
                    return (
                        f"{ep.url} answers 404 (no OpenAI-compatible API at that path: every call would fail), "
                        f"but {there} serves one: set base_url: {there}"
                    )
            if status != 200 or not model:
                continue
            try:
                served = [str(m.get("id")) for m in msgspec.json.decode(body).get("data", []) if isinstance(m, dict)]
            except (msgspec.DecodeError, AttributeError):
                continue
            if served and model not in served:
                return f"{ep.url} does not serve model {model!r} (it serves: {', '.join(served[:5])})"
        return None

    @staticmethod
    async def _api_at(ep: Endpoint, wait_s: float) -> str | None:
        """The server's ``/v1`` when it lists models there (its ``GET /v1/models`` answers 200) and ``ep`` is not
        it, else None: a base URL that probes to nothing there is not judged (a double answers any GET 404)."""
        parts = urllib.parse.urlsplit(ep.url)
        there = f"{parts.scheme}://{parts.netloc}/v1"
        if there == ep.url or ep.http is None:
            return None
        try:
            status, _ = await ep.http.get(f"{there}/models", ep.probe_headers(), timeout_s=wait_s)
        except (aiohttp.ClientError, OSError, TimeoutError):
            return None
        return there if status == 200 else None

    # ------------------------------------------------------------- replica choice

    def choose(self, rollout_key: str | None, exclude: set[int]) -> int:
        eps = self.endpoints
        now = time.monotonic()
        for i, ep in enumerate(eps):  # an endpoint out for its errors gets one call now and then: it may be back
            if ep.out is not None and i not in exclude and ep.trial_due(now):
                return i
        if len(eps) == 1:
            if eps[0].out is not None:
                raise self.all_out()
            return 0
        candidates = [i for i in range(len(eps)) if i not in exclude and eps[i].out is None]
        candidates = candidates or [i for i in range(len(eps)) if eps[i].out is None]
        if not candidates:
            raise self.all_out()
        healthy = [i for i in candidates if eps[i].healthy]
        if not healthy:  # everything is cooling down: try the one that comes back first
            return min(candidates, key=lambda i: eps[i].down_until)
        if rollout_key is not None and self.cfg.endpoint_load:
            ranked = rendezvous(rollout_key, [ep.url for ep in eps])
            # consistent hashing with bounded loads: at most ceil(c * (calls in flight + this one) / endpoints)
            bound = math.ceil(self.cfg.endpoint_load * (sum(ep.in_flight for ep in eps) + 1) / len(eps))
            for i in ranked:
                ep = eps[i]
                if i in healthy and ep.in_flight < min(bound, ep.limiter.window):
                    first = ranked[0]
                    why = "affine" if i == first else "moved" if first not in healthy else "load"
                    self.routed[why] += 1
                    return i
        self._rr += 1
        n = len(eps)
        # least loaded (relative to its window); ties broken round-robin
        return min(healthy, key=lambda i: (eps[i].in_flight / eps[i].limiter.window, (i - self._rr) % n))

    def endpoints_out(self) -> dict[str, str]:
        """The endpoints out of service now, each with why (``ModelWorker.stats``: ``why`` and ``status`` show it)."""
        return {ep.url: ep.out for ep in self.endpoints if ep.out is not None}

    def all_out(self) -> AllOut:
        said = "; ".join(f"{ep.url}: {ep.out}" for ep in self.endpoints)
        return AllOut(self.scrub(f"every endpoint is out of service ({said})"[:2000]))

    # ------------------------------------------------------- out of service, back in

    def _take_out(self, ep: Endpoint, cause: str, *, silent: bool, wait_s: float) -> None:
        """Out of service: no calls go to it (a silent one's calls in flight move now), said once in one line."""
        ep.out = self.scrub(cause)[:1000]
        ep.silent = silent
        ep.back_at = time.monotonic() + wait_s
        moved = len(ep.attempts) if silent else 0  # calls waiting on a silent one move; a failing one answers
        for scope in list(ep.attempts) if silent else []:
            scope.cancel()
        back = f"probed every {PROBE_EVERY_S:g} s" if silent else f"one call let through in {wait_s:g} s, doubling"
        log.warning("model.endpoint_out", endpoint=ep.url, cause=ep.out, calls_moved=moved, back_in=back)

    def _back(self, ep: Endpoint, how: str) -> None:
        was = ep.out
        ep.out, ep.silent, ep.trial, ep.trials_failed = None, False, False, 0
        ep.failures, ep.down_until = 0, 0.0
        ep.heard = time.monotonic()
        log.warning("model.endpoint_back", endpoint=ep.url, was=was, by=how)

    def _watch_started(self) -> None:
        """Start the watch of silent endpoints if it is not running (it ends when nothing is in flight or out)."""
        if self._watcher is None and self.cfg.stall_s and any(ep.http is not None for ep in self.endpoints):
            self._watcher = asyncio.get_running_loop().create_task(self.watch())

    async def watch(self) -> None:
        """Probe each endpoint that answered nothing for ``stall_s`` while calls waited on it, and each one out
        of service for its silence, every ``PROBE_EVERY_S``: a probe not answered takes it out, one answered
        brings it back. Probes run apart (one silent endpoint does not hold up another's)."""
        stall = self.cfg.stall_s
        tick = min(stall / 4, 2.5)
        try:
            while any(ep.in_flight or ep.out is not None for ep in self.endpoints):
                await anyio.sleep(tick)
                now = time.monotonic()
                for ep in self.endpoints:
                    if ep.http is None or ep.probing:
                        continue
                    quiet = now - ep.heard
                    if (ep.out is None and ep.in_flight and quiet > stall) or (ep.silent and now >= ep.back_at):
                        ep.probing = True
                        task = asyncio.get_running_loop().create_task(self._probe(ep, quiet))
                        self._probes.add(task)
                        task.add_done_callback(self._probes.discard)
        finally:
            self._watcher = None

    async def _probe(self, ep: Endpoint, quiet: float) -> None:
        assert ep.http is not None
        wait_s = min(self.cfg.timeout_s, PROBE_TIMEOUT_S)
        try:
            await ep.http.get(f"{ep.url}/models", ep.probe_headers(), timeout_s=wait_s)
            answered = True
        except (aiohttp.ClientError, OSError, TimeoutError):
            answered = False
        finally:
            ep.probing = False
        if answered:
            ep.heard = time.monotonic()
            if ep.silent:
                self._back(ep, "answered a probe (GET /models)")
        elif ep.out is None:
            if ep.in_flight:
                cause = (
                    f"answered nothing for {quiet:.0f} s with {ep.in_flight} calls in flight, "
                    f"nor GET /models within {wait_s:g} s"
                )
                self._take_out(ep, cause, silent=True, wait_s=PROBE_EVERY_S)
        else:
            ep.back_at = time.monotonic() + PROBE_EVERY_S

    # --------------------------------------------------------------- retry loop

    async def run(
        self,
        attempt_fn: Callable[[Endpoint], Awaitable[T]],
        *,
        rollout_key: str | None = None,
        what: str = "request",
    ) -> T:
        """Run ``attempt_fn(endpoint)`` with the retry, replica and rate-limit policy.

        ``attempt_fn`` makes the HTTP calls of one attempt; it raises
        ``ContextOverflow`` (passed through), ``ModelError`` (passed through; retried
        only when ``retryable``) or ``HTTPStatusError`` / ``HTTPTimeout`` / ``HTTPUnreachable``
        (classified here).
        """
        cfg = self.cfg
        attempts = cfg.max_retries + 1
        tried: set[int] = set()
        for attempt in range(attempts):
            index = self.choose(rollout_key, tried)
            ep = self.endpoints[index]
            trial = ep.out is not None  # out for its errors: this call is its trial
            ep.trial = ep.trial or trial
            wait: float | None = None
            failure: str
            replica_fault = True
            await ep.limiter.acquire()
            if not ep.in_flight:  # its silence is counted from now, not from its last answer long ago
                ep.heard = time.monotonic()
            ep.in_flight += 1
            scope = anyio.CancelScope(deadline=anyio.current_time() + cfg.timeout_s)
            ep.attempts.add(scope)
            self._watch_started()
            try:
                with scope:
                    result = await attempt_fn(ep)
                if scope.cancelled_caught:
                    raise TimeoutError
            except HTTPStatusError as e:
                ep.heard = time.monotonic()
                status = e.status_code
                failure = self.scrub(f"HTTP {status} from {ep.url} ({what}): {e.message}"[:1000])
                if status == 429:
                    wait = retry_after(e.headers)
                    ep.limiter.on_rate_limited(wait)
                    replica_fault = False
                elif not (status in RETRY_STATUS or status >= 500):
                    raise ModelError(failure, retryable=False) from None
                else:
                    wait = retry_after(e.headers)
            except (HTTPTimeout, TimeoutError):
                if ep.out is not None and ep.silent:  # taken out while this call waited: it moves at once
                    failure = f"{ep.url} is out of service ({ep.out})"
                    replica_fault = False
                else:
                    failure = f"timed out after {cfg.timeout_s}s waiting for {ep.url} ({what})"
            except HTTPUnreachable as e:
                failure = self.scrub(f"cannot reach {ep.url} ({what}): {e}")
            except ModelError as e:
                if not e.retryable:
                    raise
                failure = self.scrub(str(e))
                replica_fault = False
            else:
                ep.heard = time.monotonic()
                if ep.out is not None and trial:
                    self._back(ep, "a call succeeded")
                ep.mark_ok()
                ep.limiter.on_success()
                ep.served += 1
                return result
            finally:
                ep.attempts.discard(scope)
                ep.in_flight -= 1
                ep.limiter.release()
                if trial:
                    ep.trial = False

            if replica_fault:
                self._failed(ep, failure, trial=trial)
                tried.add(index)
            if attempt + 1 >= attempts:
                raise ModelError(
                    f"{failure} (gave up after {attempts} attempt{'s' if attempts > 1 else ''})",
                    retryable=True,
                )
            backoff = min(cfg.retry_backoff_s * (2**attempt), MAX_BACKOFF_S)
            backoff *= 0.5 + random.random() / 2  # jitter: concurrent rollouts spread out
            if wait is not None:
                backoff = max(backoff, wait)
            elif (replica_fault or ep.out is not None) and any(
                e.healthy for i, e in enumerate(self.endpoints) if i not in tried
            ):
                backoff = 0.0  # another replica is up: fail over at once
            self._log_retry(ep.url, failure)
            if backoff:
                await anyio.sleep(backoff)
        raise AssertionError("unreachable")  # pragma: no cover

    def _failed(self, ep: Endpoint, failure: str, *, trial: bool) -> None:
        """A call failed for the endpoint's fault: it cools down, and is out of service after ``out_after`` in a
        row; out, one trial call goes to it after ``replica_cooldown_s``, doubling with each that fails."""
        cfg = self.cfg
        ep.mark_failed(cfg.replica_cooldown_s)
        if ep.out is None and ep.failures >= cfg.out_after:
            cause = f"{ep.failures} calls failed in a row, the last: {failure}"
            self._take_out(ep, cause, silent=False, wait_s=cfg.replica_cooldown_s)
        elif trial and ep.out is not None and not ep.silent:
            ep.trials_failed += 1
            ep.back_at = time.monotonic() + min(cfg.replica_cooldown_s * 2**ep.trials_failed, MAX_COOLDOWN_S)

    async def aclose(self) -> None:
        for task in [self._watcher, *self._probes]:
            if task is not None:
                task.cancel()
        for ep in self.endpoints:
            if ep.client is not None:
                await ep.client.close()
            if ep.http is not None:
                await ep.http.aclose()


class PooledModel:
    """The face an adapter over an ``EndpointPool`` shows the model worker: whether its endpoints serve the model,
    which are out, closing; the pool's answers."""

    pool: EndpointPool
    _model: str | None

    async def check(self) -> str | None:
        """Why the endpoints cannot serve this model (the model worker asks once at start), or None."""
        return await self.pool.probe(self._model)

    def endpoints_out(self) -> dict[str, str]:
        return self.pool.endpoints_out()

    async def aclose(self) -> None:
        await self.pool.aclose()
