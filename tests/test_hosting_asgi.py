"""hosting.asgi: a hosted app's own loop and the ASGI call, with plain ASGI apps (no NeMo Gym needed).

The hosted servers themselves (their cookies, lifespan, exception middleware, a verify that blocks
its loop for 12 s) are tested end to end in tests/e2e/test_hosted_nemo_gym_*.py.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from gym_runtime.hosting.asgi import Jar, app_loop, request


async def test_code_that_blocks_the_apps_loop_leaves_the_callers_loop_running() -> None:
    """A coroutine that sleeps synchronously on the app loop for 1 s: meanwhile the caller's loop ticks on."""
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.05)

    async def blocks() -> float:
        time.sleep(1.0)
        return 1.0

    ticker = asyncio.create_task(tick())
    try:
        assert await app_loop().run(blocks()) == 1.0
    finally:
        ticker.cancel()
    assert ticks >= 10  # ~20 ticks in 1 s; on one loop there would have been 1


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
    for _ in range(100):
        if cancelled:
            break
        await asyncio.sleep(0.01)
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
