"""google_search: multiple-choice questions answered with ``search`` and ``browse`` tools.

Matches NeMo Gym's ``google_search`` resources server. Tools (NeMo Gym's schemas
and output shapes, argument semantics ``nemo_gym``):

* ``search(query)`` → ``{"search_results": "<JSON text>"}`` from the configured
  backend (``backends.py``: Google Programmable Search, Tavily, offline BM25 over
  a local corpus, or a NeMo Gym recording).
* ``browse(url)`` → ``{"page_content": "<text>"}``: the corpus's or recording's
  page for offline backends, else the fetched page's main text (``browse.py``).

``verify`` is NeMo Gym's: the graded text is the *last* output item when it is an
assistant message, and NeMo Gym runs its regex ``\\\\boxed\\{(.*?)\\}`` over
``str()`` of that message's content list, i.e. over the Python ``repr`` of each
text part (backslashes doubled, newlines as ``\\n``). So ``\\boxed{C}`` gives
``C`` but ``\\boxed{\\text{B}}`` gives ``\\\\text{B`` and reward 0, exactly as in
NeMo Gym's recorded rollouts. ``reward`` is 1.0 iff the first box's content equals
``expected_answer``; the extra field is ``parsed_option`` (null when there is no
box or the response does not end with an assistant message: NeMo Gym's verify
fails there instead).
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Annotated, Any

import msgspec

from gym_runtime.messages import Message, Response
from gym_runtime.resource import Resource, Verdict, tool
from gym_runtime.resource import parse_options as _parse_options

from .backends import SearchBackend, SearchOptions, make_backend
from .browse import BrowseLimits, browse, truncate_words

__all__ = ["GoogleSearch", "box_parser", "graded_text", "parse_options"]

_BOX = re.compile(r"\\boxed\{(.*?)\}")


def box_parser(text: str | None) -> str | None:
    """NeMo Gym's parser: the content of the first ``\\boxed{...}`` up to the first ``}``."""
    match = _BOX.search(str(text))
    return match.group(1) if match else None


def _part_repr(part: Any) -> str:
    """``repr`` of one content part as NeMo Gym's pydantic output models print it."""
    if not isinstance(part, dict):
        return repr(part)
    if part.get("type") == "refusal":
        return f"ResponseOutputRefusal(refusal={part.get('refusal', '')!r}, type='refusal')"
    return (
        f"ResponseOutputText(annotations={part.get('annotations', [])!r}, text={part.get('text', '')!r}, "
        f"type='output_text', logprobs={part.get('logprobs', [])!r})"
    )


def graded_text(response: Response) -> str | None:
    """The text NeMo Gym's verify searches: ``str(last_message.content)``, or None."""
    if not response.output:
        return None
    last = response.output[-1]
    if not isinstance(last, Message) or last.role != "assistant":
        return None
    if isinstance(last.content, str):
        return last.content
    return "[" + ", ".join(_part_repr(p) for p in last.content) + "]"


def parse_options(raw: dict[str, Any]) -> SearchOptions:
    return _parse_options(raw, SearchOptions, "google_search")


class GoogleSearchTask(msgspec.Struct, kw_only=True):
    """The task field verify reads: the option letter."""

    expected_answer: str


class GoogleSearch(Resource):
    """Stateless sessions; the backend (and its cache and rate limit) is shared per worker and event loop."""

    task_fields = GoogleSearchTask
    requires = ("bm25s", "trafilatura", "pyarrow")
    install = "pip install 'gym-runtime[search]'"
    tool_arguments = "nemo_gym"
    answer_field = "parsed_option"

    _opts: SearchOptions = SearchOptions()
    _backend: SearchBackend | None = None
    _loop: Any = None
    _client: Any = None

    @classmethod
    async def setup(cls, options: dict[str, Any]) -> None:
        opts = parse_options(options)
        if opts.corpus and not Path(opts.corpus).is_absolute():
            opts = msgspec.structs.replace(opts, corpus=str(Path(opts.corpus).resolve()))
        backend = make_backend(opts)  # a bad set-up fails here, before any rollout
        await super().setup(options)
        await cls._close_shared()
        cls._opts, cls._backend, cls._loop = opts, backend, asyncio.get_running_loop()

    @classmethod
    async def _close_shared(cls) -> None:
        same_loop = cls._loop is asyncio.get_running_loop()
        if cls._backend is not None and same_loop:
            await cls._backend.aclose()
        if cls._client is not None and same_loop:
            await cls._client.aclose()
        cls._backend = cls._client = None

    @classmethod
    async def _shared(cls) -> SearchBackend:
        """The backend of this event loop (HTTP clients belong to the loop that made them)."""
        loop = asyncio.get_running_loop()
        if cls._backend is None or cls._loop is not loop:
            cls._backend, cls._client, cls._loop = make_backend(cls._opts), None, loop
        return cls._backend

    @classmethod
    def _browser(cls) -> Any:
        import httpx2

        if cls._client is None:
            cls._client = httpx2.AsyncClient(timeout=cls._opts.browse_timeout_s, follow_redirects=False)
        return cls._client

    @tool(description="Search Google for a query and return up to 10 search results.")
    async def search(self, query: Annotated[str, msgspec.Meta(description="The term to search for")]) -> dict[str, str]:
        backend = await self._shared()
        return {"search_results": await backend.search(query)}

    @tool(
        description="Returns the cleaned content of a webpage. If the page is too long, "
        "it will be truncated to 10,000 words."
    )
    async def browse(
        self, url: Annotated[str, msgspec.Meta(description="The url of the page to get the content of")]
    ) -> dict[str, str]:
        backend = await self._shared()
        text = await backend.page(url)
        if text is None:
            if not backend.fetches_pages:
                return {"page_content": "No HTML found"}
            o = self._opts
            limits = BrowseLimits(o.browse_timeout_s, o.browse_max_bytes, o.browse_max_words, o.browse_allow_private)
            return {"page_content": await browse(self._browser(), url, limits)}
        return {"page_content": truncate_words(text, self._opts.browse_max_words)}

    async def verify(self, task: dict[str, Any], response: Response) -> Verdict:
        parsed = box_parser(graded_text(response))
        reward = 1.0 if parsed is not None and parsed == task.get("expected_answer") else 0.0
        return Verdict(reward=reward, fields={"parsed_option": parsed})
