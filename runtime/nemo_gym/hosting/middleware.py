"""NeMo Gym's two ``@app.middleware("http")`` layers as the plain ASGI middleware they can be.

Every NeMo Gym server gets two function middlewares from its base class: ``add_session_id``
(``setup_session_middleware``: a session id in the signed session cookie) and
``exception_handling_middleware`` (``setup_exception_middleware``, which ``run_webserver``
adds: an error as an HTTP 500 whose body is its ``repr``). FastAPI runs each through
Starlette's ``BaseHTTPMiddleware``, which runs the rest of the app in a task of its own
behind memory streams: measured here, two of them were most of a hosted request's CPU
(1.7 ms a request against 0.3 ms for the same app with plain ASGI layers). ``lighten``
puts ``SessionId`` and ``ErrorsAsReplies`` in their places: the same session id, the same
status and body for each error, in the caller's task. A server that overrides either
method (its own function has another ``__qualname__``) keeps its own.

The error's traceback is logged (NeMo Gym prints it), not sent: the model sees the ``repr``.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

from gym_runtime.observability import logs

log = logs.get("gym.hosting")

Scope = dict[str, Any]


class SessionId:
    """``add_session_id``: the session's id kept, or a new one, set on every request (so the cookie is
    sent back each time, as Starlette >= 1.0 sends it only for a session that was written to)."""

    def __init__(self, app: Any, key: str) -> None:
        self.app = app
        self.key = key

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            session = scope["session"]
            # written either way; a new id only for a new session (NeMo Gym's made one for every request)
            session[self.key] = session[self.key] if self.key in session else str(uuid.uuid4())
        await self.app(scope, receive, send)


class ErrorsAsReplies:
    """``exception_handling_middleware``: an error raised before the response began is an HTTP 500 with a
    JSON string body: an inner server's error reply (``ClientResponseError``) named as such, a
    cancellation inside the server's code "Request was cancelled", any other exception its ``repr``,
    anything else "An unknown error occurred". A cancellation of the request itself (its caller stopped
    waiting) stays one."""

    def __init__(self, app: Any, name: str, key: str, upstream: type[BaseException]) -> None:
        self.app = app
        self.name = name
        self.key = key
        self.upstream = upstream

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if started or (task is not None and task.cancelling()):
                raise
            await _reply(send, "Request was cancelled")
        except BaseException as e:
            if started or isinstance(e, KeyboardInterrupt):
                raise
            if isinstance(e, self.upstream):
                body = f"Hit an exception in {self.key} calling an inner server: {getattr(e, 'response_content', e)}"
            elif isinstance(e, Exception):
                body = repr(e)
            else:
                body = "An unknown error occurred"
            log.warning("hosted request raised", server=self.name, path=scope.get("path"), error=repr(e), exc_info=e)
            await _reply(send, body)


async def _reply(send: Any, text: str) -> None:
    """A 500 whose body is ``text`` as a JSON string, as FastAPI's ``JSONResponse(text, 500)`` sends it."""
    body = json.dumps(text, ensure_ascii=False, separators=(",", ":")).encode()
    headers = [(b"content-length", str(len(body)).encode()), (b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": 500, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def lighten(app: Any, instance: Any) -> None:
    """``instance``'s app (after ``setup_webserver``) with NeMo Gym's base-class function middlewares as
    plain ASGI: ``add_session_id`` replaced where it stands, the exception layer added outermost (where
    ``setup_exception_middleware`` adds it); a server's own versions of either are left as they are."""
    from aiohttp import ClientResponseError
    from nemo_gym.server_utils import SESSION_ID_KEY, SimpleServer
    from starlette.middleware import Middleware

    ours = f"{SimpleServer.setup_session_middleware.__qualname__}.<locals>.add_session_id"
    for i, layer in enumerate(app.user_middleware):
        dispatch = layer.kwargs.get("dispatch")
        if getattr(dispatch, "__module__", None) == SimpleServer.__module__ and dispatch.__qualname__ == ours:
            app.user_middleware[i] = Middleware(SessionId, key=SESSION_ID_KEY)
    if type(instance).setup_exception_middleware is SimpleServer.setup_exception_middleware:
        name = getattr(instance.config, "name", type(instance).__name__)
        key = instance.get_session_middleware_key()
        app.add_middleware(ErrorsAsReplies, name=name, key=key, upstream=ClientResponseError)
    else:
        instance.setup_exception_middleware(app)
