"""Google and Tavily backends and browse against local STUB HTTP servers (stub_search.py): real HTTP, fake services."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

from gym_runtime.resources.google_search import GoogleSearch
from gym_runtime.resources.google_search.backends import GoogleBackend, SearchOptions, TavilyBackend

from .stub_search import StubSearch

KEY = "stub-key-s3cr3t"


@pytest.fixture
def stub() -> Iterator[StubSearch]:
    with StubSearch() as s:
        yield s


@pytest.fixture(autouse=True)
def keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GOOGLE_API_KEY", KEY)
    monkeypatch.setenv("GOOGLE_CX", "stub-cx")
    monkeypatch.setenv("TAVILY_API_KEY", "tvly-" + KEY)


def google(stub: StubSearch, **kw: Any) -> GoogleBackend:
    return GoogleBackend(
        SearchOptions(backend="google", google_url=f"{stub.url}/customsearch/v1", backoff_s=0.01, **kw)
    )


async def session(stub: StubSearch, **options: Any) -> GoogleSearch:
    await GoogleSearch.setup({"browse_allow_private": True, "browse_timeout_s": 3.0, **options})
    return GoogleSearch()


async def test_google_answer_passes_through_with_key_and_cx(stub: StubSearch) -> None:
    backend = google(stub)
    out = await backend.search("carnot engine")
    assert json.loads(out)["items"][0]["link"] == "https://example.org/carnot engine"
    assert out == json.dumps(json.loads(out))  # NeMo Gym: json.dumps of Google's body (ensure_ascii, ", ")
    assert "\\u2019" in out
    assert stub.seen_params[-1] == {"key": KEY, "cx": "stub-cx", "q": "carnot engine"}
    await backend.aclose()


async def test_retries_on_503_and_429_then_succeed(stub: StubSearch) -> None:
    backend = google(stub, max_retries=3)
    assert "items" in json.loads(await backend.search("flaky-2"))
    assert stub.hits["flaky-2"] == 3
    assert "items" in json.loads(await backend.search("limited"))  # Retry-After: 0 honoured
    assert stub.hits["limited"] == 2
    await backend.aclose()


async def test_exhausted_retries_and_errors_become_nemo_gym_error_text_without_the_key(stub: StubSearch) -> None:
    backend = google(stub, max_retries=1)
    out = await backend.search("flaky-9")
    assert out == "Error: Unexpected error - google search answered HTTP 503 (2 attempts)"
    out = await backend.search("forbidden")
    assert out.startswith("Error: Unexpected error - google search answered HTTP 403") and KEY not in out
    assert "***" in out
    await backend.aclose()


async def test_timeout_per_request(stub: StubSearch) -> None:
    backend = google(stub, max_retries=0, timeout_s=0.3)
    start = time.monotonic()
    out = await backend.search("slow")
    assert out == "Error: Unexpected error - google search timed out after 0.3 s (1 attempts)"
    assert time.monotonic() - start < 1.8  # the stub answers after 2 s
    await backend.aclose()


async def test_identical_queries_in_a_batch_cost_one_request(stub: StubSearch) -> None:
    backend = google(stub)
    results: list[str] = []

    async def one() -> None:
        results.append(await backend.search("same question"))

    async with anyio.create_task_group() as tg:
        for _ in range(8):
            tg.start_soon(one)
    results.append(await backend.search("same question"))
    assert len(set(results)) == 1 and stub.hits["same question"] == 1
    assert (backend.cache.misses, backend.cache.hits) == (1, 8)
    await backend.aclose()


async def test_rate_limit_spaces_requests(stub: StubSearch) -> None:
    backend = google(stub, requests_per_s=5.0)
    start = time.monotonic()
    async with anyio.create_task_group() as tg:
        for i in range(6):
            tg.start_soon(backend.search, f"q{i}")
    assert time.monotonic() - start >= 0.95  # 6 starts at 5/s: the last one waits 1 s
    await backend.aclose()


def test_missing_key_is_one_clear_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GOOGLE_CX")
    with pytest.raises(ValueError, match="environment variable GOOGLE_CX, which is not set"):
        GoogleBackend(SearchOptions(backend="google"))


async def test_keys_from_the_config_as_nemo_gym_names_them(stub: StubSearch, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GOOGLE_API_KEY")
    monkeypatch.delenv("GOOGLE_CX")
    backend = GoogleBackend(
        SearchOptions(
            backend="google", google_url=f"{stub.url}/customsearch/v1", google_api_key="cfg-key", google_cx="cfg-cx"
        )
    )
    await backend.search("q")
    assert stub.seen_params[-1] == {"key": "cfg-key", "cx": "cfg-cx", "q": "q"}
    await backend.aclose()


async def test_tavily_results_reshaped_as_google(stub: StubSearch) -> None:
    backend = TavilyBackend(SearchOptions(backend="tavily", tavily_url=f"{stub.url}/tavily/search", top_k=3))
    body = json.loads(await backend.search("heat engines"))
    assert body["kind"] == "customsearch#search"
    assert [i["link"] for i in body["items"]] == [f"https://site{i}.example/heat engines" for i in range(3)]
    assert body["items"][0]["displayLink"] == "site0.example" and body["items"][0]["snippet"] == "Snippet 0."
    assert stub.seen_auth == ["Bearer tvly-" + KEY]
    await backend.aclose()


async def test_search_tool_through_a_resource_session(stub: StubSearch) -> None:
    inst = await session(stub, backend="google", google_url=f"{stub.url}/customsearch/v1")
    out = json.loads(await inst.call_tool("search", '{"query": "entropy"}'))
    assert json.loads(out["search_results"])["items"][0]["title"] == "About entropy"


# ------------------------------------------------------------------ browse


async def browse(stub: StubSearch, path: str, **options: Any) -> str:
    inst = await session(stub, backend="google", **options)
    return json.loads(await inst.call_tool("browse", json.dumps({"url": stub.url + path})))["page_content"]


async def test_browse_extracts_main_text(stub: StubSearch) -> None:
    text = await browse(stub, "/page/article")
    assert "depends only on the temperatures" in text and "Home | About" not in text
    assert await browse(stub, "/page/redirect") == text


@pytest.mark.parametrize(
    ("path", "answer"),
    [
        ("/page/pdf", "No HTML found"),
        ("/page/missing", "No HTML found"),
        ("/page/empty", "No text found"),
        ("/page/loop", "Error: Unexpected error = more than 5 redirects"),
    ],
)
async def test_browse_answers_like_nemo_gym(stub: StubSearch, path: str, answer: str) -> None:
    assert await browse(stub, path) == answer


async def test_browse_keeps_first_and_last_5000_characters_of_long_pages(stub: StubSearch) -> None:
    text = await browse(stub, "/page/long")
    assert len(text) == 10_003 and text[5000:5003] == "..."
    assert text.startswith("Long") and text.rstrip().endswith("word119x99.")


async def test_browse_cuts_the_body_at_max_bytes(stub: StubSearch) -> None:
    assert "TAILMARK" in await browse(stub, "/page/huge", browse_max_bytes=10_000_000, browse_max_words=10**7)
    text = await browse(stub, "/page/huge", browse_max_bytes=200_000, browse_max_words=10**7)
    assert "TAILMARK" not in text and "depends only on the temperatures" in text


async def test_browse_time_limit(stub: StubSearch) -> None:
    start = time.monotonic()
    text = await browse(stub, "/page/slow", browse_timeout_s=0.5)
    assert text == "Error: Unexpected error = fetching the page took longer than 0.5 s"
    assert time.monotonic() - start < 4.0  # the stub answers after 5 s


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("file:///etc/passwd", "only http and https URLs can be browsed"),
        ("http://127.0.0.1:9/", "private or local address"),
        ("http://[::1]:9/", "private or local address"),
        ("http://169.254.169.254/latest/meta-data/", "private or local address"),
    ],
)
async def test_browse_refuses_hostile_urls(url: str, reason: str) -> None:
    await GoogleSearch.setup({"backend": "tavily"})
    out = json.loads(await GoogleSearch().call_tool("browse", json.dumps({"url": url})))["page_content"]
    assert out.startswith("Error: Unexpected error = ") and reason in out
