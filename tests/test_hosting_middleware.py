"""hosting.middleware's layers around plain ASGI apps (no NeMo Gym needed): what a cancellation or an error
after the response began does, which the comparison with NeMo Gym's own middleware cannot show (the whole
comparison: tests/e2e/test_hosted_nemo_gym_servers.py, on the crashy server)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gym_runtime.nemo_gym.hosting.asgi import request
from gym_runtime.nemo_gym.hosting.middleware import ErrorsAsReplies, SessionId


class Upstream(Exception):
    response_content = b"down"


def wrapped(app: Any) -> ErrorsAsReplies:
    return ErrorsAsReplies(app, name="srv", key="Srv___srv", upstream=Upstream)


async def test_an_error_before_the_response_is_a_500_with_its_repr() -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        raise KeyError("k")

    assert await request(wrapped(app), "/t", b"{}", None) == (500, [], b"\"KeyError('k')\"")


async def test_an_inner_servers_error_names_its_content() -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        raise Upstream

    status, _, body = await request(wrapped(app), "/t", b"{}", None)
    assert (status, body) == (500, b"\"Hit an exception in Srv___srv calling an inner server: b'down'\"")


async def test_the_callers_cancellation_stays_a_cancellation() -> None:
    """A request whose caller stopped waiting ends cancelled: no 500 reply is sent for it."""
    sent: list[dict[str, Any]] = []
    started = asyncio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        started.set()
        await asyncio.sleep(60)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}"}

    task = asyncio.create_task(wrapped(app)({"type": "http", "path": "/t"}, receive, send))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sent == []


async def test_an_error_after_the_response_began_is_raised_not_answered_twice() -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise RuntimeError("mid-body")

    with pytest.raises(RuntimeError, match="mid-body"):
        await request(wrapped(app), "/t", b"{}", None)


async def test_the_session_id_is_kept_or_made() -> None:
    seen: list[dict[str, Any]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append(dict(scope["session"]))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    layer = SessionId(app, key="session_id")
    for session in ({}, {"session_id": "kept"}):
        await layer({"type": "http", "session": session}, None, _discard)
    assert len(seen[0]["session_id"]) == 36 and seen[1] == {"session_id": "kept"}


async def _discard(message: dict[str, Any]) -> None:
    pass
