"""A hosted NeMo Gym app on an event loop of its own, called with one minimal ASGI request at a time.

NeMo Gym's servers are its code, and some block their event loop: toolsandbox's ``/close``
scores an episode synchronously for 13-45 s. On the worker's own loop that silenced the bus
(no keepalives, no other session's calls) past its 10 s liveness window, and the rollouts in
flight became ``worker_lost``. So the app runs on ``AppLoop``: a thread with an asyncio loop
of its own (uvloop where installed, as uvicorn would run it), where its requests, its lifespan
and the tasks its code starts live, while the worker's bus loop only waits on futures. One per
process, not per server: NeMo Gym's shared aiohttp session is process-wide, bound to the loop
that made it. Context variables cross with each call both ways (``run_coroutine_threadsafe``
copies the caller's context), so a server's model calls keep the span of the call that made them.

``request`` is what ``httpx.ASGITransport`` sent, without httpx's request and response objects
(measured: most of our own CPU per hosted rollout): a scope, the body as one message, the
response's status, ``set-cookie`` values and body. ``Jar`` is one rollout's cookies (NeMo Gym's
session cookie, signed by Starlette's ``SessionMiddleware``), kept as a browser keeps one host's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import email.utils
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

SERVER = ("nemo-gym.hosted", 80)  # never resolved: no request leaves the process
CLIENT = ("127.0.0.1", 123)  # what httpx.ASGITransport tells the app its client is
_ASGI = {"version": "3.0"}
_HEADERS = [(b"host", b"nemo-gym.hosted"), (b"content-type", b"application/json")]


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class AppLoop:
    """The hosted apps' event loop: run by a daemon thread for the life of the process, or (``thread=False``)
    by whoever calls ``run_forever`` on it: the main thread of a hosted worker's process (``beside_main``)."""

    def __init__(self, *, thread: bool = True) -> None:
        self.loop = _new_loop()
        if thread:
            threading.Thread(target=self._run, name="nemo-gym-app", daemon=True).start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """``coro`` run on the app's loop and awaited from the caller's (cancelling the wait cancels it there).

        What ``run_coroutine_threadsafe`` + ``wrap_future`` do, with one future on each loop and no
        ``concurrent.futures.Future`` (a lock and a condition apiece) between them: the hop is every hosted
        call's, seed and verify, and measured 112-137 -> 61-75 us of CPU (two loops in two threads, 64 in
        flight). The task runs in the caller's context (its trace and log ids), as it did."""
        caller = asyncio.get_running_loop()
        answer: asyncio.Future[T] = caller.create_future()
        hop = _Hop(caller, answer, _awaited(coro))
        self.loop.call_soon_threadsafe(hop.start)
        try:
            return await answer
        except asyncio.CancelledError:
            if not hop.ended:
                self.loop.call_soon_threadsafe(hop.cancel)  # after ``start``: the loop runs them in order
            raise


class _Hop:
    """One ``AppLoop.run`` call: its task on the app's loop and its answer on the caller's."""

    __slots__ = ("answer", "caller", "coro", "ended", "task")

    def __init__(self, caller: asyncio.AbstractEventLoop, answer: asyncio.Future[Any], coro: Coroutine[Any, Any, Any]):
        self.caller = caller
        self.answer = answer
        self.coro = coro
        self.task: asyncio.Task[Any] | None = None
        self.ended = False

    def start(self) -> None:  # on the app's loop
        self.task = asyncio.get_running_loop().create_task(self.coro)
        self.task.add_done_callback(self._ended)

    def cancel(self) -> None:  # on the app's loop, after ``start``
        if self.task is not None:
            self.task.cancel()

    def _ended(self, task: asyncio.Task[Any]) -> None:  # on the app's loop
        self.ended = True
        if not self.caller.is_closed():
            self.caller.call_soon_threadsafe(self._answer, task)

    def _answer(self, task: asyncio.Task[Any]) -> None:  # on the caller's loop
        if self.answer.done():  # its caller stopped waiting
            if not task.cancelled():
                task.exception()  # read, so asyncio does not log it as never retrieved
        elif task.cancelled():
            self.answer.cancel()
        elif (error := task.exception()) is not None:
            self.answer.set_exception(error)
        else:
            self.answer.set_result(task.result())


async def _awaited(coro: Coroutine[Any, Any, T]) -> T:
    """``coro``, as a call from another loop runs it: an error it ends with once its caller stopped waiting
    (Starlette's ``BaseHTTPMiddleware`` answers a cancellation with "No response returned.") ends it as
    cancelled, since no one is left to read it; asyncio would log it, traceback and all, as never retrieved."""
    try:
        return await coro
    except Exception:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise asyncio.CancelledError from None
        raise


class AppLife:
    """An app's life on an ``AppLoop``, as uvicorn runs one: built there (``build``; ``start`` raises what
    building or the lifespan's startup raised) and its lifespan hooks run in one task from ``start`` to ``stop``."""

    def __init__(self, loop: AppLoop, build: Callable[[], Any]) -> None:
        self.loop = loop
        self._build = build
        self._life: concurrent.futures.Future[None] | None = None
        self._stopping: asyncio.Event | None = None

    async def start(self) -> None:
        ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._life = self.loop.submit(self._serve(ready))
        await asyncio.wrap_future(ready)

    async def _serve(self, ready: concurrent.futures.Future[None]) -> None:
        try:
            app = self._build()
            self._stopping = asyncio.Event()
            async with app.router.lifespan_context(app):
                ready.set_result(None)
                await self._stopping.wait()
        except BaseException as e:
            if ready.done():
                raise
            ready.set_exception(e)

    async def stop(self) -> None:
        """The lifespan's shutdown hooks run (on the app's loop), once; a no-op if it never started."""
        if self._life is not None and self._stopping is not None:
            self.loop.loop.call_soon_threadsafe(self._stopping.set)
            await asyncio.wrap_future(self._life)


_APP_LOOP: list[AppLoop] = []


def app_loop() -> AppLoop:
    """This process's app loop, started on first use (on a thread, unless ``beside_main`` made it)."""
    if not _APP_LOOP:
        _APP_LOOP.append(AppLoop())
    return _APP_LOOP[0]


class ForwardedSignals:
    """SIGTERM/SIGINT received by the main thread's loop, handed to the bus loop on another thread: what
    ``anyio.open_signal_receiver`` gives a worker on the main thread (signals arriving before it listens wait)."""

    def __init__(self) -> None:
        self._early: list[int] = []
        self._queue: asyncio.Queue[int] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def deliver(self, signum: int) -> None:
        if self._queue is None or self._loop is None:
            self._early.append(signum)
        else:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, signum)

    @contextlib.contextmanager
    def receiver(self, *_signals: int) -> Iterator[AsyncIterator[int]]:
        queue: asyncio.Queue[int] = asyncio.Queue()
        for signum in self._early:
            queue.put_nowait(signum)
        self._loop, self._queue = asyncio.get_running_loop(), queue

        try:
            yield _Received(queue)
        finally:
            self._queue = None


class _Received:
    """The signals as they arrive. An iterator object, not an async generator: a wait cancelled in the
    middle (the worker stops waiting for its server) must leave it usable for the next ``async for``."""

    def __init__(self, queue: asyncio.Queue[int]) -> None:
        self._queue = queue

    def __aiter__(self) -> _Received:
        return self

    async def __anext__(self) -> int:
        return await self._queue.get()


def beside_main(work: Callable[[ForwardedSignals], T]) -> T:
    """``work`` (the worker: its bus loop) on a thread, while this, the main thread, runs the hosted apps' loop.

    NeMo Gym's servers run on uvicorn's main thread, and some of their code relies on it: ``signal.alarm``
    timeouts (math-verify in imo_proofbench_judge's and physics_judge's verify, nvarc) work on the main
    thread only ("signal only works in main thread"). So in a hosted worker's process the app keeps the main
    thread and the bus gets the other; SIGTERM and SIGINT reach the worker through ``ForwardedSignals``."""
    app = AppLoop(thread=False)
    _APP_LOOP[:] = [app]
    signals = ForwardedSignals()
    done: list[T] = []
    failed: list[BaseException] = []

    def target() -> None:
        try:
            done.append(work(signals))
        except BaseException as e:  # re-raised on the main thread, as if work had run there
            failed.append(e)
        finally:
            app.loop.call_soon_threadsafe(app.loop.stop)

    asyncio.set_event_loop(app.loop)
    for signum in (signal.SIGTERM, signal.SIGINT):
        app.loop.add_signal_handler(signum, signals.deliver, signum)
    bus = threading.Thread(target=target, name="gym-bus")
    bus.start()
    app.loop.run_forever()
    bus.join()
    if failed:
        raise failed[0]
    return done[0]


async def on_loop(loop: asyncio.AbstractEventLoop | None, coro: Coroutine[Any, Any, T]) -> T:
    """``coro`` run on ``loop`` (the worker's bus loop), from whichever loop awaits it: a hop from another."""
    if loop is None or asyncio.get_running_loop() is loop:
        return await coro
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(_awaited(coro), loop))


async def request(
    app: Any, path: str, body: bytes, cookie: bytes | None, method: str = "POST"
) -> tuple[int, list[bytes], bytes]:
    """``POST path`` (or ``method``) with a JSON ``body`` through ``app``, on the running loop: (status,
    set-cookie values, body). An exception the app raises (no exception middleware caught it) propagates,
    as httpx's did."""
    path, _, query = path.partition("?")
    headers = [*_HEADERS, (b"content-length", str(len(body)).encode())]
    if cookie:
        headers.append((b"cookie", cookie))
    scope = {
        "type": "http",
        "asgi": _ASGI,
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "root_path": "",
        "headers": headers,
        "server": SERVER,
        "client": CLIENT,
    }
    status = 500
    cookies: list[bytes] = []
    chunks: list[bytes] = []
    sent = complete = False
    waiter: asyncio.Future[None] | None = None

    async def receive() -> dict[str, Any]:
        nonlocal sent, waiter
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        if not complete:  # the body was read: a disconnect only once the response is complete
            waiter = waiter or asyncio.get_running_loop().create_future()
            await asyncio.shield(waiter)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        kind = message["type"]
        if kind == "http.response.start":
            status = message["status"]
            cookies.extend(v for k, v in message.get("headers") or () if k.lower() == b"set-cookie")
        elif kind == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                _complete()

    def _complete() -> None:
        nonlocal complete
        complete = True
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    try:
        await app(scope, receive, send)
    finally:
        _complete()
    return status, cookies, b"".join(chunks)


class Jar:
    """One rollout's cookies for the one host it talks to (NeMo Gym's session cookie)."""

    __slots__ = ("_cookies",)

    def __init__(self) -> None:
        self._cookies: dict[str, str] = {}

    def header(self) -> bytes | None:
        if not self._cookies:
            return None
        return "; ".join(f"{k}={v}" for k, v in self._cookies.items()).encode("latin-1")

    def update(self, set_cookies: list[bytes]) -> None:
        """The response's ``set-cookie`` values: each sets its cookie, or deletes it if already expired."""
        for raw in set_cookies:
            first, *attrs = raw.decode("latin-1").split(";")
            name, _, value = first.partition("=")
            if _expired(attrs):
                self._cookies.pop(name.strip(), None)
            else:
                self._cookies[name.strip()] = value.strip()


def _expired(attrs: list[str]) -> bool:
    """Whether a cookie's attributes say it has expired (``Max-Age`` first, then ``Expires``, as browsers do)."""
    found = {}
    for attr in attrs:
        key, _, value = attr.strip().partition("=")
        found[key.lower()] = value.strip()
    if "max-age" in found:
        try:
            return int(found["max-age"]) <= 0
        except ValueError:
            pass
    if "expires" in found:
        try:
            return email.utils.parsedate_to_datetime(found["expires"]).timestamp() <= time.time()
        except (TypeError, ValueError):
            pass
    return False
