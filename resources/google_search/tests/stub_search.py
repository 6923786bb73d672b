"""STUB servers standing in for paid search APIs (Google Programmable Search, Tavily) and web pages.

A real HTTP server on 127.0.0.1 (a thread of ``http.server``): the backends
under test speak real HTTP to it. It answers like the real services in the
parts our code reads, and misbehaves on request (``q=flaky-N``: N answers of 503
first; ``q=limited``: 429 with ``Retry-After: 0`` once; ``q=slow``: a late
answer) so retries, timeouts and caching can be checked.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

ARTICLE = """<html><head><title>Carnot engines</title></head><body>
<nav>Home | About | Contact</nav>
<article><h1>Carnot engines</h1>
<p>The efficiency of a Carnot engine depends only on the temperatures of its two reservoirs.</p>
<p>It does not depend on the working substance or on the heat capacities of the reservoirs,
which is why the Carnot efficiency is a universal upper bound for heat engines.</p>
<p>Scaling both temperatures by the same factor leaves the efficiency unchanged.</p>
</article><footer>Copyright stub</footer></body></html>"""


def _long_page(words: int) -> str:
    paras = "".join(f"<p>{' '.join(f'word{i}x{j}' for j in range(100))}.</p>" for i in range(words // 100))
    return f"<html><body><article><h1>Long</h1>{paras}</article></body></html>"


class _Handler(BaseHTTPRequestHandler):
    """The stub's answers; ``stub`` is set on the subclass each ``StubSearch`` serves with."""

    stub: StubSearch

    def log_message(self, *a: Any) -> None:
        pass

    def _send(
        self,
        status: int,
        body: str | bytes,
        ctype: str = "application/json",
        headers: dict[str, str] | None = None,
    ) -> None:
        data = body.encode() if isinstance(body, str) else body
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        try:
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _misbehave(self, q: str) -> bool:
        with self.stub.lock:
            self.stub.hits[q] += 1
            n = self.stub.hits[q]
        if q.startswith("flaky-") and n <= int(q.split("-")[1]):
            self._send(503, '{"error": "backend unavailable"}')
            return True
        if q == "limited" and n == 1:
            self._send(429, '{"error": "rate limited"}', headers={"Retry-After": "0"})
            return True
        if q == "slow":
            time.sleep(2.0)
        if q == "forbidden":
            params = self.stub.seen_params[-1] if self.stub.seen_params else {}
            self._send(403, json.dumps({"error": f"bad key {params.get('key')}"}))
            return True
        return False

    def do_GET(self) -> None:
        parts = urlsplit(self.path)
        if parts.path == "/customsearch/v1":
            params = {k: v[0] for k, v in parse_qs(parts.query).items()}
            self.stub.seen_params.append(params)
            q = params.get("q", "")
            if self._misbehave(q):
                return
            body = {
                "kind": "customsearch#search",
                "queries": {"request": [{"searchTerms": q}]},
                "items": [
                    {
                        "kind": "customsearch#result",
                        "title": f"About {q}",
                        "link": f"https://example.org/{q}",
                        "snippet": f"Everything about {q} \u2019s details.",
                    }
                ],
            }
            self._send(200, json.dumps(body))
            return
        with self.stub.lock:
            self.stub.hits[parts.path] += 1
        if parts.path == "/page/article":
            self._send(200, ARTICLE, "text/html; charset=utf-8")
        elif parts.path == "/page/redirect":
            self._send(302, "", "text/html", {"Location": "/page/article"})
        elif parts.path == "/page/loop":
            self._send(302, "", "text/html", {"Location": "/page/loop"})
        elif parts.path == "/page/long":
            self._send(200, _long_page(12_000), "text/html")
        elif parts.path == "/page/huge":
            tail = "filler text here. " * 200_000 + "TAILMARK after the byte limit.</p></article>"
            self._send(200, ARTICLE.replace("</article>", "<p>" + tail), "text/html")
        elif parts.path == "/page/slow":
            time.sleep(5.0)
            self._send(200, ARTICLE, "text/html")
        elif parts.path == "/page/pdf":
            self._send(200, b"%PDF-1.4 binary", "application/pdf")
        elif parts.path == "/page/empty":
            self._send(200, "<html><body></body></html>", "text/html")
        else:
            self._send(404, "not found", "text/plain")

    def do_POST(self) -> None:
        parts = urlsplit(self.path)
        length = int(self.headers.get("Content-Length", "0"))
        body = json.loads(self.rfile.read(length) or b"{}")
        self.stub.seen_auth.append(self.headers.get("Authorization", ""))
        if parts.path != "/tavily/search":
            self._send(404, "{}")
            return
        q = body.get("query", "")
        if self._misbehave(q):
            return
        results = [
            {
                "title": f"Result {i} for {q}",
                "url": f"https://site{i}.example/{q}",
                "content": f"Snippet {i}.",
                "score": 1.0 - i / 10,
            }
            for i in range(int(body.get("max_results", 5)))
        ]
        self._send(200, json.dumps({"query": q, "results": results, "response_time": 0.01}))


class StubSearch:
    """Start with ``with StubSearch() as stub:``; ``stub.url`` is its base URL."""

    def __init__(self) -> None:
        self.hits: Counter[str] = Counter()  # requests per query / page path
        self.seen_params: list[dict[str, Any]] = []
        self.seen_auth: list[str] = []
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), type("Handler", (_Handler,), {"stub": self}))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> StubSearch:  # noqa: PYI034
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
