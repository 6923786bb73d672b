"""Search backends behind one small interface, chosen by ``options.backend``.

A backend answers ``search(query)`` with the string the model reads as
``search_results`` and may know pages itself (``page(url)``: the offline corpus,
a recording) so that ``browse`` never touches the network for them.

* ``google``: Google Programmable Search (Custom Search JSON API); the JSON
  answer is passed through as NeMo Gym does (``json.dumps`` of the body). The
  key and engine id come from the options (NeMo Gym's ``google_api_key`` and
  ``google_cx``, e.g. ``${GOOGLE_API_KEY}``) or else from the environment.
* ``tavily``: Tavily's search API, its results reshaped as Google's
  (``items`` with ``title``, ``link``, ``displayLink``, ``snippet``) so a policy
  sees one format whatever the backend.
* ``offline``: BM25 (``bm25s``) over a local JSONL or Parquet corpus of
  ``url, title, text`` rows; Google-shaped results; ``browse`` serves the
  corpus's pages and nothing else (air-gapped clusters, tests).
* ``recorded``: the search results and pages of a NeMo Gym rollouts file,
  keyed by the call's arguments (replaying recorded trajectories offline).

The HTTP backends share a per-backend rate limit (requests per second),
retries with backoff on 429/5xx/timeouts (``Retry-After`` honoured) and a cache
of identical queries (an LRU; concurrent identical queries share one request).
Failures become NeMo Gym's ``Error: Unexpected error - ...`` text, never an
exception the rollout dies of; API keys are scrubbed from every message.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import random
import time
from pathlib import Path
from typing import Any, Literal, Protocol
from urllib.parse import urlsplit

import anyio
import msgspec

DATA = Path(__file__).resolve().parent / "data"
GOOGLE_URL = "https://www.googleapis.com/customsearch/v1"
TAVILY_URL = "https://api.tavily.com/search"
RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
logging.getLogger("bm25s").setLevel(logging.WARNING)  # it logs every index build at DEBUG


class SearchOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``options`` of the google_search resource (config.yaml)."""

    backend: Literal["offline", "google", "tavily", "recorded"] = "offline"
    top_k: int = 10
    # offline: JSONL or Parquet with url, title, text (default: the bundled example corpus)
    corpus: str | None = None
    # recorded: a NeMo Gym rollouts JSONL whose search/browse outputs answer the calls
    rollouts: str | None = None
    google_url: str = GOOGLE_URL
    # Secrets: NeMo Gym's config names (google_api_key, google_cx), usually `${VAR}` from env.yaml;
    # when unset they are read from the environment variables named below.
    google_api_key: str | None = None
    google_cx: str | None = None
    google_api_key_env: str = "GOOGLE_API_KEY"
    google_cx_env: str = "GOOGLE_CX"
    tavily_url: str = TAVILY_URL
    tavily_api_key: str | None = None
    tavily_api_key_env: str = "TAVILY_API_KEY"
    requests_per_s: float = 5.0  # per backend and worker process
    max_retries: int = 3
    backoff_s: float = 0.5
    timeout_s: float = 10.0  # one search request (NeMo Gym: 10 s)
    cache_size: int = 4096  # identical queries answered once per worker
    browse_timeout_s: float = 20.0  # whole fetch, redirects included
    browse_max_bytes: int = 5_000_000  # the body is cut here before extraction
    browse_max_words: int = 10_000  # longer pages keep their first and last 5,000 characters (NeMo Gym)
    browse_allow_private: bool = False  # fetch loopback/private addresses (tests, intranets)

    def __post_init__(self) -> None:
        for name in ("top_k", "cache_size", "browse_max_bytes", "browse_max_words"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.requests_per_s <= 0 or self.timeout_s <= 0 or self.browse_timeout_s <= 0:
            raise ValueError("requests_per_s, timeout_s and browse_timeout_s must be > 0")
        if self.max_retries < 0:
            raise ValueError("max_retries must be >= 0")


class SearchError(Exception):
    """A search that failed for good; its text is what the model reads (no secrets)."""


def error_text(err: BaseException) -> str:
    """NeMo Gym's wording for a failed search."""
    return f"Error: Unexpected error - {err}"


class SearchBackend(Protocol):
    name: str
    # False: pages come only from ``page`` (offline, recorded); True: browse fetches the URL.
    fetches_pages: bool

    async def search(self, query: str) -> str: ...

    async def page(self, url: str) -> str | None: ...

    async def aclose(self) -> None: ...


# ------------------------------------------------------------------ shared HTTP plumbing


class RateLimiter:
    """At most ``rate`` request starts per second (evenly spaced), per backend."""

    def __init__(self, rate: float) -> None:
        self.interval = 1.0 / rate
        self.next_at = 0.0
        self.lock = anyio.Lock()

    async def wait(self) -> None:
        async with self.lock:
            now = time.monotonic()
            start = max(now, self.next_at)
            self.next_at = start + self.interval
        if start > now:
            await anyio.sleep(start - now)


class QueryCache:
    """LRU of finished answers plus in-flight sharing: N identical queries cost one request."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.done: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.pending: dict[str, tuple[anyio.Event, list[Any]]] = {}
        self.hits = 0
        self.misses = 0

    async def get(self, key: str, compute: Any) -> str:
        if key in self.done:
            self.done.move_to_end(key)
            self.hits += 1
            return self.done[key]
        if key in self.pending:
            self.hits += 1
            event, box = self.pending[key]
            await event.wait()
            if isinstance(box[0], BaseException):
                raise SearchError(str(box[0]))
            return box[0]
        self.misses += 1
        event, box = anyio.Event(), [None]
        self.pending[key] = (event, box)
        try:
            box[0] = await compute()
        except BaseException as e:
            box[0] = e
            raise
        finally:
            del self.pending[key]
            event.set()
        self.done[key] = box[0]
        while len(self.done) > self.size:
            self.done.popitem(last=False)
        return box[0]


def _retry_after(headers: Any) -> float | None:
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, min(float(value), 60.0))
    except ValueError:
        return None


class HttpBackend:
    """Rate limit, retries and cache around one HTTP search API (subclasses build the request)."""

    name = "http"
    fetches_pages = True

    def __init__(self, opts: SearchOptions, secrets: tuple[str, ...]) -> None:
        self.opts = opts
        self.secrets = tuple(s for s in secrets if s)
        self.limiter = RateLimiter(opts.requests_per_s)
        self.cache = QueryCache(opts.cache_size)
        self.client: Any = None
        self.requests = 0  # HTTP requests sent (tests, benchmarks)

    def _scrub(self, text: str) -> str:
        for s in self.secrets:
            text = text.replace(s, "***")
        return text

    def _client(self) -> Any:
        import httpx2

        if self.client is None:
            self.client = httpx2.AsyncClient(timeout=self.opts.timeout_s, follow_redirects=False)
        return self.client

    async def _request(self, query: str) -> Any:
        raise NotImplementedError

    def _render(self, body: Any) -> str:
        raise NotImplementedError

    async def search(self, query: str) -> str:
        try:
            return await self.cache.get(query, lambda: self._search_uncached(query))
        except SearchError as e:
            return error_text(e)

    async def _search_uncached(self, query: str) -> str:
        import httpx2

        last = "no attempt"
        wait = 0.0
        for attempt in range(self.opts.max_retries + 1):
            if attempt:
                await anyio.sleep(wait)
            await self.limiter.wait()
            wait = min(self.opts.backoff_s * 2**attempt, 30.0) * (0.5 + random.random() / 2)
            try:
                self.requests += 1
                with anyio.fail_after(self.opts.timeout_s):
                    resp = await self._request(query)
            except (TimeoutError, httpx2.TimeoutException):
                last = f"{self.name} search timed out after {self.opts.timeout_s:g} s"
                continue
            except httpx2.TransportError as e:
                last = self._scrub(f"{self.name} search failed: {type(e).__name__}: {e}")
                continue
            if resp.status_code in RETRY_STATUS:
                last = f"{self.name} search answered HTTP {resp.status_code}"
                wait = _retry_after(resp.headers) or wait
                continue
            if resp.status_code >= 400:
                raise SearchError(
                    f"{self.name} search answered HTTP {resp.status_code}: {self._scrub(resp.text[:300])}"
                )
            try:
                body = json.loads(resp.text)
            except ValueError:
                raise SearchError(f"{self.name} search answered a body that is not JSON") from None
            return self._render(body)
        raise SearchError(f"{last} ({self.opts.max_retries + 1} attempts)")

    async def page(self, url: str) -> str | None:
        return None

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.aclose()
            self.client = None


def _secret(given: str | None, name: str, what: str) -> str:
    """The configured secret, else the environment variable ``name`` (one clear line when neither is set)."""
    value = given or os.environ.get(name, "")
    if not value:
        raise ValueError(f"google_search: {what} is read from the environment variable {name}, which is not set")
    return value


class GoogleBackend(HttpBackend):
    """Google Programmable Search (``key`` and ``cx`` from the environment)."""

    name = "google"

    def __init__(self, opts: SearchOptions) -> None:
        self.key = _secret(opts.google_api_key, opts.google_api_key_env, "the Google API key")
        self.cx = _secret(opts.google_cx, opts.google_cx_env, "the Programmable Search engine id (cx)")
        super().__init__(opts, (self.key, self.cx))

    async def _request(self, query: str) -> Any:
        return await self._client().get(self.opts.google_url, params={"key": self.key, "cx": self.cx, "q": query})

    def _render(self, body: Any) -> str:
        return json.dumps(body)  # NeMo Gym passes Google's answer through as it is


def google_shaped(query: str, hits: list[tuple[str, str, str]]) -> str:
    """(title, link, snippet) hits as a Custom Search answer (the fields a model reads)."""
    items = [
        {"kind": "customsearch#result", "title": t, "link": u, "displayLink": urlsplit(u).netloc, "snippet": s}
        for t, u, s in hits
    ]
    body: dict[str, Any] = {
        "kind": "customsearch#search",
        "queries": {"request": [{"searchTerms": query, "count": len(items)}]},
        "searchInformation": {"totalResults": str(len(items))},
    }
    if items:
        body["items"] = items
    return json.dumps(body)


class TavilyBackend(HttpBackend):
    """Tavily's search API (``Authorization: Bearer`` key from the environment)."""

    name = "tavily"

    def __init__(self, opts: SearchOptions) -> None:
        self.key = _secret(opts.tavily_api_key, opts.tavily_api_key_env, "the Tavily API key")
        super().__init__(opts, (self.key,))

    async def _request(self, query: str) -> Any:
        return await self._client().post(
            self.opts.tavily_url,
            json={"query": query, "max_results": min(self.opts.top_k, 20), "search_depth": "basic"},
            headers={"Authorization": f"Bearer {self.key}"},
        )

    def _render(self, body: Any) -> str:
        results = body.get("results") if isinstance(body, dict) else None
        if not isinstance(results, list):
            raise SearchError("tavily search answered without a results list")
        hits = [
            (str(r.get("title", "")), str(r.get("url", "")), str(r.get("content", "")))
            for r in results
            if isinstance(r, dict) and r.get("url")
        ]
        return google_shaped(str(body.get("query", "")), hits[: self.opts.top_k])


# ------------------------------------------------------------------ offline and recorded


class Page(msgspec.Struct):
    url: str
    title: str
    text: str


def load_corpus(path: str | Path) -> list[Page]:
    """Rows of ``url, title, text`` from JSONL or Parquet (``pyarrow`` needed for Parquet)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"google_search: corpus {path} not found")
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError("google_search: a Parquet corpus needs pyarrow (pip install pyarrow)") from None
        rows = pq.read_table(path, columns=["url", "title", "text"]).to_pylist()
    else:
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    try:
        pages = msgspec.convert(rows, list[Page])
    except msgspec.ValidationError as e:
        raise ValueError(f"google_search: corpus {path}: {e} (each row needs url, title, text)") from None
    if not pages:
        raise ValueError(f"google_search: corpus {path} is empty")
    return pages


def _snippet(text: str, terms: set[str], width: int = 300) -> str:
    """The ``width`` characters around the first sentence that holds most query terms."""
    sentences = [s.strip() for s in text.replace("\n", " ").split(". ") if s.strip()]
    best = max(sentences, key=lambda s: sum(t in s.lower() for t in terms), default="")
    return best if len(best) <= width else best[: width - 3] + "..."


class OfflineBackend:
    """BM25 over a local corpus; browse serves the corpus's pages (no network at all)."""

    name = "offline"
    fetches_pages = False

    def __init__(self, opts: SearchOptions) -> None:
        import bm25s

        self.opts = opts
        self.pages = load_corpus(opts.corpus or DATA / "corpus.jsonl")
        self.by_url = {p.url: p for p in self.pages}
        self.bm25s = bm25s
        tokens = bm25s.tokenize([f"{p.title}\n{p.text}" for p in self.pages], stopwords="en", show_progress=False)
        self.index = bm25s.BM25()
        self.index.index(tokens, show_progress=False)
        self.cache = QueryCache(opts.cache_size)

    def rank(self, query: str) -> list[tuple[Page, float]]:
        """Pages with a positive BM25 score, best first (at most ``top_k``)."""
        q = self.bm25s.tokenize([query], stopwords="en", show_progress=False, return_ids=False)
        if not q[0]:
            return []
        k = min(self.opts.top_k, len(self.pages))
        docs, scores = self.index.retrieve(q, k=k, show_progress=False, n_threads=1)
        return [(self.pages[int(d)], float(s)) for d, s in zip(docs[0], scores[0], strict=True) if s > 0]

    async def search(self, query: str) -> str:
        async def compute() -> str:
            terms = {t.lower() for t in query.split() if len(t) > 2}
            hits = [(p.title, p.url, _snippet(p.text, terms)) for p, _ in self.rank(query)]
            return google_shaped(query, hits)

        return await self.cache.get(query, compute)

    async def page(self, url: str) -> str | None:
        p = self.by_url.get(url) or self.by_url.get(url.rstrip("/"))
        return p.text if p else None

    async def aclose(self) -> None:
        return None


class RecordedBackend:
    """Answers from a NeMo Gym rollouts file: what the recorded search and browse calls returned."""

    name = "recorded"
    fetches_pages = False

    def __init__(self, opts: SearchOptions) -> None:
        if not opts.rollouts:
            raise ValueError("google_search: backend 'recorded' needs options.rollouts (a rollouts JSONL)")
        path = Path(opts.rollouts)
        if not path.exists():
            raise ValueError(f"google_search: rollouts file {path} not found")
        self.searches: dict[str, str] = {}
        self.pages: dict[str, str] = {}
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                self._learn(json.loads(line).get("response", {}).get("output", []))

    def _learn(self, output: list[dict[str, Any]]) -> None:
        outputs = {i.get("call_id"): i.get("output") for i in output if i.get("type") == "function_call_output"}
        for item in output:
            if item.get("type") != "function_call" or item.get("call_id") not in outputs:
                continue
            try:
                args = json.loads(item.get("arguments") or "{}")
                result = json.loads(outputs[item["call_id"]] or "")  # no output: not a result
            except ValueError:
                continue
            if item.get("name") == "search" and "search_results" in result:
                self.searches[str(args.get("query"))] = result["search_results"]
            elif item.get("name") == "browse" and "page_content" in result:
                self.pages[str(args.get("url"))] = result["page_content"]

    async def search(self, query: str) -> str:
        found = self.searches.get(query)
        return found if found is not None else error_text(SearchError("no recorded result for this query"))

    async def page(self, url: str) -> str | None:
        return self.pages.get(url)

    async def aclose(self) -> None:
        return None


def make_backend(opts: SearchOptions) -> SearchBackend:
    """The backend ``opts.backend`` names (raises ValueError with one clear line on a bad set-up)."""
    kinds: dict[str, Any] = {
        "offline": OfflineBackend,
        "google": GoogleBackend,
        "tavily": TavilyBackend,
        "recorded": RecordedBackend,
    }
    return kinds[opts.backend](opts)
