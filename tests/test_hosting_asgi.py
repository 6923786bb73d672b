"""hosting.asgi: a hosted app's own loop and the ASGI call, with plain ASGI apps (no NeMo Gym needed).

The hosted servers and agents themselves (their cookies, lifespan, exception middleware, a verify or
an agent's /run that blocks its loop past the liveness window) are tested end to end in
tests/e2e/test_hosted_nemo_gym_*.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import gc
import threading
from collections.abc import AsyncIterator
from typing import Any

from gym_runtime.nemo_gym.hosting.asgi import AppLife, Jar, app_loop, request
from tests.helpers import eventually


async def test_code_that_blocks_the_apps_loop_leaves_the_callers_loop_running() -> None:
    """A coroutine that blocks the app loop synchronously until the caller's loop has ticked ten times: it
    returns only because the caller's loop ticks on meanwhile; on one loop the ticks would wait for it."""
    ticks = 0
    ticked = threading.Event()

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            if ticks >= 10:
                ticked.set()
            await asyncio.sleep(0.05)

    async def blocks() -> bool:
        return ticked.wait(timeout=60)  # synchronous: the app's loop runs nothing else meanwhile

    ticker = asyncio.create_task(tick())
    try:
        assert await app_loop().run(blocks()) is True  # the ticks came while it blocked (an event, not a span)
    finally:
        ticker.cancel()
    assert ticks >= 10


async def test_cancelling_the_wait_cancels_the_call_on_the_apps_loop() -> None:
    cancelled: list[bool] = []

    async def forever() -> None:
        started_on.append(asyncio.get_running_loop())
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    started_on: list[asyncio.AbstractEventLoop] = []
    task = asyncio.create_task(app_loop().run(forever()))
    while not started_on:
        await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await eventually(lambda: cancelled)  # the app's loop runs the cancellation when it gets to it
    assert started_on[0] is app_loop().loop and cancelled == [True]


async def session_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Counts calls in a cookie, as NeMo Gym's session cookie does; ``/end`` clears it as Starlette does.
    It reads its body, then waits for the disconnect (as Starlette's BaseHTTPMiddleware listens for one)."""
    message = await receive()
    assert message == {"type": "http.request", "body": b'{"x": 1}', "more_body": False}
    cookie = dict(scope["headers"]).get(b"cookie", b"")
    count = int(cookie.partition(b"n=")[2] or 0) + 1
    if scope["path"] == "/end":
        set_cookie = b"n=null; path=/; expires=Thu, 01 Jan 1970 00:00:00 GMT; httponly"
    else:
        set_cookie = f"n={count}; path=/; Max-Age=1209600; httponly; samesite=lax".encode()
    disconnect = asyncio.ensure_future(receive())
    await asyncio.sleep(0.01)
    assert not disconnect.done()  # no disconnect while the response is not complete
    headers = [(b"content-type", b"application/json"), (b"set-cookie", set_cookie)]
    await send({"type": "http.response.start", "status": 201, "headers": headers})
    await send({"type": "http.response.body", "body": str(count).encode()})
    assert await disconnect == {"type": "http.disconnect"}


async def test_a_rollouts_jar_carries_its_cookie_from_call_to_call_until_cleared() -> None:
    jar, other = Jar(), Jar()

    async def post(j: Jar, path: str) -> tuple[int, bytes]:
        status, cookies, body = await app_loop().run(request(session_app, path, b'{"x": 1}', j.header()))
        j.update(cookies)
        return status, body

    assert [await post(jar, "/a") for _ in range(3)] == [(201, b"1"), (201, b"2"), (201, b"3")]
    assert await post(other, "/a") == (201, b"1")  # another rollout, another session
    assert jar.header() == b"n=3"
    assert await post(jar, "/end") == (201, b"4")
    assert jar.header() is None  # an expired cookie is deleted
    assert await post(jar, "/a") == (201, b"1")


async def test_an_exception_the_app_raises_reaches_the_caller() -> None:
    async def crashes(scope: dict[str, Any], receive: Any, send: Any) -> None:
        raise ValueError("boom")

    try:
        await app_loop().run(request(crashes, "/x", b"{}", None))
    except ValueError as e:
        assert str(e) == "boom"
    else:
        raise AssertionError("no exception")


async def test_a_context_variable_set_by_the_caller_reaches_the_tasks_the_app_starts() -> None:
    """What finds a hosted agent's rollout inside its handler: the caller's context crosses to the app's
    loop with the call, and a task the app starts there copies it."""
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")

    async def spawns() -> tuple[str, bool]:
        return await asyncio.create_task(reads())

    async def reads() -> tuple[str, bool]:
        return var.get(), asyncio.get_running_loop() is app_loop().loop

    var.set("rollout 7")
    assert await app_loop().run(spawns()) == ("rollout 7", True)


async def test_an_apps_life_runs_on_the_apps_loop_from_start_to_stop() -> None:
    """Built and its lifespan's startup and shutdown run on the app's loop, in one task; a build error is
    what start raises."""
    seen: list[tuple[str, bool, asyncio.Task[Any] | None]] = []

    def mark(what: str) -> None:
        seen.append((what, asyncio.get_running_loop() is app_loop().loop, asyncio.current_task()))

    class App:
        def __init__(self) -> None:
            self.router = self

        @contextlib.asynccontextmanager
        async def lifespan_context(self, app: Any) -> AsyncIterator[None]:
            mark("up")
            yield
            mark("down")

    def build() -> App:
        mark("built")
        return App()

    life = AppLife(app_loop(), build)
    await life.start()
    assert [w for w, *_ in seen] == ["built", "up"]
    await life.stop()
    assert [w for w, *_ in seen] == ["built", "up", "down"]
    assert all(on_app for _, on_app, _ in seen) and len({task for *_, task in seen}) == 1

    def fails() -> App:
        raise RuntimeError("no such agent")

    try:
        await AppLife(app_loop(), fails).start()
    except RuntimeError as e:
        assert str(e) == "no such agent"
    else:
        raise AssertionError("no exception")


async def test_a_call_reaches_the_app_with_its_method_and_query() -> None:
    async def echo(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        body = f"{scope['method']} {scope['path']} {scope['query_string'].decode()}".encode()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})

    assert await request(echo, "/v1/responses?x=1", b"{}", None, "GET") == (200, [], b"GET /v1/responses x=1")


async def test_an_error_a_cancelled_call_ends_with_is_not_logged_as_never_retrieved() -> None:
    """Starlette's BaseHTTPMiddleware answers a cancellation with RuntimeError("No response returned."): once
    the caller stopped waiting (a rollout's timeout), that error has no one to reach and is dropped, where
    asyncio would log it with its traceback ("Task exception was never retrieved") for each such rollout."""
    unretrieved: list[str] = []
    loop = app_loop().loop
    loop.set_exception_handler(lambda _loop, context: unretrieved.append(context["message"]))
    started = asyncio.Event()
    caller = asyncio.get_running_loop()

    async def answers_cancel_with_an_error() -> None:
        caller.call_soon_threadsafe(started.set)
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise RuntimeError("No response returned.") from None

    try:
        task = asyncio.create_task(app_loop().run(answers_cancel_with_an_error()))
        await started.wait()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0.1)
        await app_loop().run(asyncio.sleep(0))  # the app's loop has run the cancelled call's end
        gc.collect()
    finally:
        loop.set_exception_handler(None)
    assert unretrieved == []
