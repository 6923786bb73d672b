"""``browse``: fetch a page and extract its main text (trafilatura), within limits.

The URL comes from the policy, so it is hostile input: only ``http``/``https``;
loopback, private and link-local addresses are refused unless the config allows
them (``browse_allow_private``, for tests and intranets); the whole fetch
(redirects included, at most 5) has a time limit; the body is read up to a byte
limit and cut there; extraction runs in a worker thread. The answers are NeMo
Gym's: the extracted text, ``No text found``, ``No HTML found``, or
``Error: Unexpected error = ...``; a page over ``max_words`` words keeps its
first and last 5,000 characters joined by ``...`` (NeMo Gym's rule).
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin, urlsplit

import anyio

MAX_REDIRECTS = 5
KEEP_CHARS = 5000


class BrowseError(Exception):
    """The text after ``Error: Unexpected error = `` (what NeMo Gym's browse answers on failure)."""


@dataclass(frozen=True, slots=True)
class BrowseLimits:
    timeout_s: float = 20.0
    max_bytes: int = 5_000_000
    max_words: int = 10_000
    allow_private: bool = False


def truncate_words(text: str, max_words: int) -> str:
    """NeMo Gym's cut: over ``max_words`` words, keep the first and last 5,000 characters."""
    if len(text.split()) > max_words:
        return text[:KEEP_CHARS] + "..." + text[-KEEP_CHARS:]
    return text


async def _check_host(url: str, allow_private: bool) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise BrowseError(f"only http and https URLs can be browsed, not {parts.scheme or 'a relative URL'!r}")
    host = parts.hostname
    if not host:
        raise BrowseError("the URL has no host")
    if allow_private:
        return
    try:
        infos = await anyio.getaddrinfo(
            host, parts.port or (443 if parts.scheme == "https" else 80), type=socket.SOCK_STREAM
        )
    except OSError as e:
        raise BrowseError(f"cannot resolve {host}: {e}") from None
    for info in infos:
        addr = ipaddress.ip_address(info[4][0])
        if addr.is_private or addr.is_loopback or addr.is_link_local or addr.is_reserved or addr.is_multicast:
            raise BrowseError(f"{host} is a private or local address; browsing it is not allowed")


async def _read_limited(resp: Any, max_bytes: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.aiter_bytes():
        chunks.append(chunk)
        size += len(chunk)
        if size >= max_bytes:
            break  # cut the page here: enough to extract from, bounded memory
    return b"".join(chunks)[:max_bytes]


async def fetch_html(client: Any, url: str, limits: BrowseLimits) -> str | None:
    """The page's HTML (decoded), or None when there is no HTML to extract from."""
    for _ in range(MAX_REDIRECTS + 1):
        await _check_host(url, limits.allow_private)
        async with client.stream("GET", url, headers={"User-Agent": "gym-runtime-browse/1"}) as resp:
            if resp.status_code in (301, 302, 303, 307, 308) and "location" in resp.headers:
                url = urljoin(url, resp.headers["location"])
                continue
            if resp.status_code >= 400:
                return None  # trafilatura.fetch_url gives None for error statuses too
            ctype = resp.headers.get("content-type", "text/html").lower()
            if not any(t in ctype for t in ("html", "xml", "text/plain")):
                return None
            body = await _read_limited(resp, limits.max_bytes)
            return body.decode(resp.encoding or "utf-8", errors="replace")
    raise BrowseError(f"more than {MAX_REDIRECTS} redirects")


def extract_text(html: str) -> str | None:
    import trafilatura

    return trafilatura.extract(html)


async def browse(client: Any, url: str, limits: BrowseLimits) -> str:
    """What the model reads as ``page_content`` for ``url``."""
    import httpx2

    try:
        with anyio.fail_after(limits.timeout_s):
            html = await fetch_html(client, url, limits)
            if not html:
                return "No HTML found"
            text = await anyio.to_thread.run_sync(extract_text, html, abandon_on_cancel=True)
    except TimeoutError:
        return f"Error: Unexpected error = fetching the page took longer than {limits.timeout_s:g} s"
    except BrowseError as e:
        return f"Error: Unexpected error = {e}"
    except httpx2.HTTPError as e:
        return f"Error: Unexpected error = {type(e).__name__}: {e}"
    if not text:
        return "No text found"
    return truncate_words(text, limits.max_words)
