"""A NeMo Gym resources server's own code, in process, behind gym-runtime's ``Resource`` protocol.

The server class is built as NeMo Gym's ``run_webserver`` builds it (its config class
from its YAML defaults plus the config's ``options``, a ``ServerClient`` over a global
config dict, ``setup_webserver()``, its exception middleware (both function middlewares as plain ASGI:
``hosting.middleware``), then called in process
with one ASGI request per call (``hosting.asgi``): no port is opened, no head server or
Ray is started by us (a server whose own code starts Ray gets a Ray on loopback only, see
``prepare``). The app, its lifespan and every task its code starts run on an event loop
of their own (``hosting.asgi.AppLoop``; the main thread in a hosted worker's process, see
``beside_main``), never on the worker's bus loop: a server that blocks its loop (a
synchronous grader) delays its own requests, not the worker's keepalives or its bus
traffic; what server code asks of the bus (model calls, other servers) hops to the bus
loop and back.

* one cookie jar (so one NeMo Gym session) per rollout; the session is an actor pinned to
  its worker like every session;
* ``seed`` → ``POST /seed_session`` (the whole row); a tool → ``POST /<tool>`` with the
  model's arguments as the body, the reply body as the tool output: a crashing tool is
  NeMo Gym's HTTP 500 whose body is ``repr(e)``, which is what its simple agent shows the
  model. Only the server's tool routes (``tool_definitions``; with a catch-all ``POST
  /{tool_name}``, any one-segment name outside its protocol) are tools: a model's call named
  ``verify``, ``seed_session``, ``nemo_gym.http`` or anything else that is not one reads
  FastAPI's 404 body, ``{"detail":"Not Found"}``, and never reaches the endpoint;
* ``verify`` → ``POST /verify`` (row | response); every field the server answers beyond the
  request (``_ng_failure_class``, ``failure_kind``, ``extracted_answer`` ...) becomes a field
  of the row;
* gymnasium-style servers (``/reset``, ``/step``) are a ``GymResource``;
* a hosted NeMo Gym agent that speaks its server's own protocol (``toolsandbox_agent``:
  ``/seed_session``'s ``env_id``, ``/step`` and ``/close`` by ``env_id``) reaches it through
  one session operation (``Session.operate``, never a model's call), ``PASSTHROUGH``: the
  agent's path and body posted as they are, the status and body answered as they are
  (``/seed_session``: the reply to the seed the session opened with); a ``/verify`` row may
  carry the posted response's fields our ``Response`` does not hold (``RESPONSE_EXTRA``), put
  back into the response the server reads;
* lifespan hooks run for the life of the worker (``setup`` enters, ``teardown`` leaves);
* the server's ``server_client`` calls to a model the config names (a judge, a user
  simulator), ``/v1/responses`` or ``/v1/chat/completions``, go to that model's workers
  over the bus (``Resource.models``: token ids, policy versions, retries and traces as for
  any model call);
* so do requests of the server's own clients to a model's URL: in its global config a
  model's host is ``NAME.models.gym-runtime.invalid`` (``get_server_url(NAME)``), and a
  base URL option may name it too (``http://judge.models.gym-runtime.invalid/v1``).
  NeMo Gym's one shared aiohttp session (``nemo_gym.server_utils.request``, which its
  ``NeMoGymAsyncOpenAI`` uses) is wrapped, and httpx's transports (the ``openai``
  package's clients) patched, so that requests to those hosts never leave the process
  (made for the server whose request is being handled: ``_CURRENT``); any other host goes
  out as before. A synchronous client waits for the bus loop from the server's loop or a
  thread of its own alike (gdpval calls its sync ``OpenAI`` in ``asyncio.to_thread``). No
  port is opened for this, and the ``.invalid`` domain never resolves, so a client none of
  this reaches fails instead of reaching the network. The patches are the process's, not
  scoped to the server's clients: its code builds those itself (``openai.AsyncOpenAI`` in a
  verify, ``requests.post`` at setup) and takes no transport from us; they divert only
  requests to those ``.invalid`` hosts, and under ``isolation: process`` the process runs
  only that server;
* calls to another resources server of the config by name (``server_client.post(NAME,
  path)``) reach that server's workers over the bus as a session of ours: ``/seed_session``
  opens it, its reply carries a cookie naming it, so the calls that send that cookie back
  (tools, ``/verify``) reach the same session; a ``/verify`` or tool call without one
  opens a fresh session. Under ``server --secure`` the server permits a pool only the
  environments its ``resources.NAME.calls`` names (``gym_runtime.ops.permissions``).

Imported only by a worker running in the server's built environment (``hosting.env``):
nemo-gym, fastapi and httpx are imported when a server is loaded, never at import time.
"""

from __future__ import annotations

import asyncio
import contextvars
import importlib
import json
import os
import re
import sys
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import msgspec

from gym_runtime.agent import Session
from gym_runtime.chat import chat_body_to_params, response_to_chat
from gym_runtime.data.rowkeys import own_fields
from gym_runtime.errors import Failure, UserError
from gym_runtime.gymnasium import Action, GymResource, Reset, Step
from gym_runtime.messages import Response, SandboxCall, SandboxReply, create_params
from gym_runtime.nemo_gym.hosting.asgi import AppLife, AppLoop, Jar, app_loop, on_loop, request
from gym_runtime.nemo_gym.hosting.middleware import lighten
from gym_runtime.nemo_gym.hosting.server_client import NOT_MINE, server_client
from gym_runtime.resource import (
    ENV_CALL,
    ENV_THREAD,
    OPERATION_PREFIXES,
    ModelClient,
    Resource,
    ThreadMarked,
    ToolArgumentsError,
    Verdict,
    in_call,
    thread_call,
)
from gym_runtime.transport.bus import Bus

MODEL_HOST = "gym-runtime.models"  # a model's "host" in a hosted agent's global config (never resolved)
# A model's host in a hosted server's global config, NAME.models.gym-runtime.invalid, and another
# resources server's, NAME.resources.gym-runtime.invalid: .invalid names never resolve (RFC 2606).
MODELS_DOMAIN = "models.gym-runtime.invalid"
RESOURCES_DOMAIN = "resources.gym-runtime.invalid"
SANDBOX_PROVIDER = "gym_runtime"  # NeMo Gym's name for the fleet (pyproject's nemo_gym.sandbox_providers)
SESSION_COOKIE = "gym_runtime_session"  # the cookie naming a session opened on another resources server
CALL_TIMEOUT_S = 300.0  # one call to another resources server (its worker's liveness still applies)
PASSTHROUGH = "nemo_gym.http"  # session op: a hosted agent's call to its hosted server's route, unchanged
RESPONSE_EXTRA = "_ng_response_extra"  # verify row key: the posted response's fields beyond our Response
NOT_FOUND = b'{"detail":"Not Found"}'  # FastAPI's answer to a path that is not a route: a tool it does not declare
MAX_CALLED_SESSIONS = 20_000  # sessions a worker keeps open on other servers; past it the oldest is closed
_ENDPOINTS = {
    "/seed_session",
    "/verify",
    "/aggregate_metrics",
    "/close_session",
    "/reverify_mode",
    "/reset",
    "/step",
    "/close",
    "/",
}
_CATCH_ALL = re.compile(r"/\{[^/{}]+\}")  # POST /{tool_name}: a server whose rows name its tools
_ONE_SEGMENT = re.compile(r"[^/?#%\s]+")  # a name a catch-all route takes as it is
RAY_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": a Ray started here uses loopback only
_ECHOED = ("responses_create_params", "response", "reward")
_DESCRIPTIVE = {"entrypoint", "domain", "verified", "verified_url", "description", "value", "license"}


def _post_paths(app: Any) -> list[str]:
    """The paths of the app's ``POST`` routes that its OpenAPI schema lists (FastAPI's own routes, in the schema),
    read from the routes themselves."""
    from fastapi.routing import APIRoute

    return [
        r.path_format
        for r in app.routes
        if isinstance(r, APIRoute) and r.include_in_schema and "POST" in (r.methods or ())
    ]


def _is_tool_path(path: str) -> bool:
    """A ``POST`` path a model's call may name: not NeMo Gym's protocol's, no path parameter."""
    return path not in _ENDPOINTS and "{" not in path


class HostedServerError(RuntimeError):
    """The hosted server answered a protocol call (seed, verify, reset, step) with an error status."""


def plain(body: Any) -> Any:
    """A ``json=`` argument as NeMo Gym's client sends it (pydantic models dumped, unset fields left out)."""
    dump = getattr(body, "model_dump", None)
    return dump(mode="json", exclude_unset=True) if dump is not None else body


class _Reply:
    """The part of aiohttp's ``ClientResponse`` NeMo Gym servers read from ``server_client`` calls."""

    def __init__(self, status: int, body: bytes, cookies: dict[str, Any] | None = None) -> None:
        self.status = status
        self.ok = status < 400
        self._body = body
        self.cookies: dict[str, Any] = cookies or {}
        self.headers: dict[str, str] = {"content-type": "application/json"}
        self.content = self

    async def read(self) -> bytes:
        return self._body

    async def json(self, **_: Any) -> Any:
        return json.loads(self._body)

    async def text(self, **_: Any) -> str:
        return self._body.decode()

    def raise_for_status(self) -> None:
        if not self.ok:
            raise HostedServerError(f"model call failed with HTTP {self.status}: {self._body[:500].decode()}")

    def release(self) -> None:
        return None

    def close(self) -> None:
        return None

    async def wait_for_close(self) -> None:
        return None


def called_reply(status: int, body: bytes, token: str) -> _Reply:
    """What the server's client reads of a call to another resources server made for it by the worker."""
    return _Reply(status, body, {SESSION_COOKIE: token} if token else None)


def _error(status: int, message: str) -> _Reply:
    return _Reply(status, json.dumps({"error": {"message": message}}).encode())


class _Pending:
    """What aiohttp's ``session.request(...)`` returns: awaitable, or an ``async with`` context."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self._reply: _Reply | None = None

    def __await__(self) -> Any:
        return self._call.__await__()

    async def __aenter__(self) -> _Reply:
        self._reply = await self._call
        return self._reply

    async def __aexit__(self, *exc: object) -> None:
        if self._reply is not None:
            self._reply.release()


def _cookie(cookies: Any, key: str) -> str | None:
    """One cookie's value from what a caller passes as ``cookies=`` (a dict, aiohttp's morsels, None)."""
    value = cookies.get(key) if hasattr(cookies, "get") else None
    value = getattr(value, "value", value)
    return value if isinstance(value, str) else None


# The hosted server whose request is being handled (set around each ASGI request): process-wide clients
# (NeMo Gym's shared session, httpx's transports) route a request to our hosts through that server's host.
_CURRENT: contextvars.ContextVar[ServerHost | None] = contextvars.ContextVar("gym_hosted_server", default=None)


def current_host() -> ServerHost | None:
    """The hosted server whose request the running code serves (None outside one)."""
    return _CURRENT.get()


def _ours(host: str | None) -> bool:
    return (host or "").endswith(".gym-runtime.invalid")


class _BusSession:
    """NeMo Gym's shared aiohttp session, except that a request to one of our hosts
    (``NAME.models.gym-runtime.invalid``, ``NAME.resources.gym-runtime.invalid``) goes over the bus."""

    def __init__(self, host: ServerHost, inner: Any) -> None:
        self._host = host
        self._inner = inner

    def request(self, method: str, url: Any, **kwargs: Any) -> Any:
        import yarl

        u = yarl.URL(str(url))
        if not _ours(u.host):
            return self._inner.request(method, url, **kwargs)
        body = kwargs.get("json")
        if body is None and kwargs.get("data"):
            body = json.loads(kwargs["data"])
        host = _CURRENT.get() or self._host
        return _Pending(host.url_call(u.host or "", method, u.path, body))

    def get(self, url: Any, **kwargs: Any) -> Any:
        return self.request("GET", url, **kwargs)

    def post(self, url: Any, **kwargs: Any) -> Any:
        return self.request("POST", url, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _route_httpx(first: ServerHost) -> None:
    """The ``openai`` package's own clients (httpx) too: httpx's transports send a request to one of our
    hosts over the bus and any other as before. A synchronous client waits for the bus loop from the
    server's loop (blocking it, as under NeMo Gym) or from a thread of its own (gdpval's ``to_thread``)."""
    import httpx

    if getattr(httpx.AsyncHTTPTransport.handle_async_request, "_gym_routed", False):
        return
    send_async = httpx.AsyncHTTPTransport.handle_async_request
    send_sync = httpx.HTTPTransport.handle_request

    async def call(request: httpx.Request, body: bytes, host: ServerHost) -> httpx.Response:
        reply = await host.url_call(request.url.host, request.method, request.url.path, json.loads(body or b"null"))
        return httpx.Response(reply.status, content=await reply.read(), headers=reply.headers)

    async def handle_async_request(self: httpx.AsyncHTTPTransport, request: httpx.Request) -> httpx.Response:
        if not _ours(request.url.host):
            return await send_async(self, request)
        return await call(request, await request.aread(), _CURRENT.get() or first)

    def handle_request(self: httpx.HTTPTransport, request: httpx.Request) -> httpx.Response:
        if not _ours(request.url.host):
            return send_sync(self, request)
        host = _CURRENT.get() or first
        loop = host.bus_loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is None or running is loop:
            raise RuntimeError(f"{request.url}: a synchronous client on the bus loop's thread cannot wait for the bus")
        return asyncio.run_coroutine_threadsafe(call(request, request.read(), host), loop).result()

    handle_async_request._gym_routed = True  # type: ignore[attr-defined]
    httpx.AsyncHTTPTransport.handle_async_request = handle_async_request  # type: ignore[method-assign]
    httpx.HTTPTransport.handle_request = handle_request  # type: ignore[method-assign]


def _route_requests(first: ServerHost) -> None:
    """The ``requests`` package too: xstest probes its judge with it in ``setup_webserver`` (a GET of the
    judge's URL, a POST to its ``/v1/responses``; any HTTP answer will do) and retries for ever while the
    name does not resolve. A request to one of our hosts waits for the bus loop, from the server's loop
    (blocking it, as under NeMo Gym) or from a thread of its own; on the bus loop's thread, where it cannot
    wait, it is answered 503 at once (an answer, no call)."""
    from urllib.parse import urlsplit

    import requests
    from requests.structures import CaseInsensitiveDict

    adapter = requests.adapters.HTTPAdapter
    if getattr(adapter.send, "_gym_routed", False):
        return
    send = adapter.send

    async def call(host: ServerHost, name: str, method: str, path: str, body: Any) -> tuple[int, bytes, Any]:
        reply = await host.url_call(name, method, path, body)
        return reply.status, await reply.read(), reply.headers

    def routed(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        url = urlsplit(request.url)
        if not _ours(url.hostname):
            return send(self, request, *args, **kwargs)
        host = _CURRENT.get() or first
        loop = host.bus_loop
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        headers: Any
        if loop is None or running is loop:
            msg = f"{request.url}: a synchronous client on the bus loop's thread cannot wait for the bus"
            status, content, headers = 503, json.dumps({"error": {"message": msg}}).encode(), {}
        else:
            body = json.loads(request.body or b"null")
            coro = call(host, url.hostname or "", request.method, url.path, body)
            status, content, headers = asyncio.run_coroutine_threadsafe(coro, loop).result()
        resp = requests.Response()
        resp.status_code, resp._content, resp.url, resp.request = status, content, request.url, request
        resp.headers = CaseInsensitiveDict(dict(headers or {}))
        return resp

    routed._gym_routed = True  # type: ignore[attr-defined]
    adapter.send = routed  # type: ignore[method-assign]


def server_configs(sdir: Path) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Each of a server's own ``configs/*.yaml`` that reads as a mapping (of its instances), with its path, in
    name order; one that is not YAML is passed over."""
    import yaml

    for path in sorted((sdir / "configs").glob("*.yaml")):
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError:
            continue
        if isinstance(data, dict):
            yield path, data


def _yaml_defaults(sdir: Path, impl: str) -> dict[str, Any]:
    """The server's own config fields from its ``configs/*.yaml`` (the first block naming it)."""
    for _, data in server_configs(sdir):
        for inst in data.values():
            block = inst.get("resources_servers", {}).get(impl) if isinstance(inst, dict) else None
            if isinstance(block, dict):
                return {k: v for k, v in block.items() if not isinstance(v, str) or "${" not in v}
    return {}


class ServerHost:
    """One NeMo Gym server class, built once per worker process, run on the process's app loop; its
    requests are made for per-rollout cookie jars (``post``)."""

    def __init__(
        self,
        server: str,
        name: str,
        options: dict[str, Any],
        model_names: list[str],
        resource_names: Iterable[str] = (),
        bus: Bus | None = None,
    ) -> None:
        self.server = server
        self.name = name
        self.options = dict(options)
        self.model_names = list(model_names)
        self.resource_names = [r for r in resource_names if r != name]
        # calls to other resources servers: sessions on ``bus`` (in process), or sent to the worker (a guest's)
        self.called = CalledSessions(bus) if bus is not None else None
        self.resources_via: Callable[[str, str, Any, str], Awaitable[_Reply]] | None = None
        # in a guest: its sandbox operations, made by the worker on the fleet (``hosting.sandbox_provider``)
        self.sandboxes_via: Callable[[SandboxCall], Coroutine[Any, Any, SandboxReply]] | None = None
        self.models: ModelClient | None = None
        self.app: Any = None
        self.instance: Any = None
        self.gymnasium = False
        self.server_cls: Any = None
        self.impl = ""
        self.fields: dict[str, Any] = {}
        self.global_config: dict[str, Any] = {}
        self.calls: dict[str, int] = {}  # calls routed over the bus, by model or resource name (tests, status)
        self.tool_names: frozenset[str] = frozenset()  # its tool routes (set by start)
        self.catch_all = False  # it declares its tools by one route, POST /{tool_name} (set by start)
        self.bus_loop: asyncio.AbstractEventLoop | None = None  # the worker's: what server code asks of the bus
        self.loop: AppLoop | None = None  # the app's own
        self._life: AppLife | None = None  # the app's life on its loop, lifespan included

    def _server_dir(self) -> Path:
        path = Path(self.server)
        if path.is_dir():
            return path.resolve()
        import resources_servers

        return Path(next(iter(resources_servers.__path__))) / self.server

    def _global_config(self, impl: str, fields: dict[str, Any]) -> dict[str, Any]:
        def entry(kind: str, name: str, domain: str) -> dict[str, Any]:
            return {kind: {"gym_runtime": {"host": f"{name}.{domain}", "port": 80, "entrypoint": "-"}}}

        return {
            "head_server": {"host": "127.0.0.1", "port": 0},
            # ``sandbox_provider: gym_runtime`` names the fleet (our entry point), as a provider config file would
            SANDBOX_PROVIDER: {SANDBOX_PROVIDER: {}},
            **{m: entry("responses_api_models", m, MODELS_DOMAIN) for m in self.model_names},
            **{r: entry("resources_servers", r, RESOURCES_DOMAIN) for r in self.resource_names},
            self.name: {"resources_servers": {impl: {**fields, "host": "127.0.0.1", "port": 0}}},
        }

    def _export_global_config(self) -> None:
        """Servers that read the global config (get_global_config_dict) find it here, as in a NeMo Gym child."""
        import yaml

        self.global_config = self._global_config(self.impl, self.fields)
        os.environ["NEMO_GYM_CONFIG_DICT"] = yaml.safe_dump(self.global_config)
        os.environ["NEMO_GYM_CONFIG_PATH"] = self.name

    def prepare(self) -> type:
        """Import the server's module (its directory becomes the working directory) and return its class."""
        from nemo_gym.server_utils import SimpleServer

        if self.server_cls is not None:
            return self.server_cls
        sdir = self._server_dir()
        self.impl = sdir.name
        os.chdir(sdir)  # servers open data files by relative path, as under NeMo Gym
        if str(sdir.parent.parent) not in sys.path:
            sys.path.append(str(sdir.parent.parent))
        if str(sdir) not in sys.path:  # `python app.py` puts the server's directory first: sibling modules import
            sys.path.insert(0, str(sdir))
        fields = {**_yaml_defaults(sdir, self.impl), **self.options}
        fields.update(entrypoint="app.py", name=self.name, host="127.0.0.1", port=0)
        self.fields = fields
        self._export_global_config()
        # a server whose code starts Ray (code_gen's `.remote()` calls) would otherwise bind Ray's gRPC servers
        # and agents to every interface and its node IP (measured: `::`, 0.0.0.0, the host's address); with
        # this Ray's node IP is 127.0.0.1 and every one of its listeners is on loopback. Read when ray is
        # imported, so set before the server's module is; an explicit setting in the environment wins.
        os.environ.setdefault(RAY_LOOPBACK_ENV, "0")
        module = importlib.import_module(f"{sdir.parent.name}.{self.impl}.app")
        self.server_cls = _server_class(module, SimpleServer)
        # descriptive YAML fields stay out of the server's config unless its config class asks for them
        # (arena's requires domain, verified, description and value)
        declared = getattr(self.server_cls.model_fields["config"].annotation, "model_fields", {})
        self.fields = {k: v for k, v in self.fields.items() if k not in _DESCRIPTIVE or k in declared}
        self._export_global_config()
        self.gymnasium = any(c.__name__ == "GymnasiumServer" for c in self.server_cls.__mro__)
        return self.server_cls

    async def start(self) -> None:
        """Build the server on the app's loop as NeMo Gym's run_webserver does, minus the port; enter its
        lifespan there (left by ``stop``). Returns once the app is ready; an error building it is raised here."""
        self.bus_loop = asyncio.get_running_loop()
        self.loop = app_loop()
        self._life = AppLife(self.loop, self._build)
        await self._life.start()
        posts = _post_paths(self.app)
        self.tool_names = frozenset(p.lstrip("/") for p in posts if _is_tool_path(p))
        self.catch_all = any(_CATCH_ALL.fullmatch(p) for p in posts)

    def is_tool(self, name: str) -> bool:
        """Whether a model's call named ``name`` goes to the server: one of its tool routes, or, where it
        declares its tools by one catch-all route (its rows name them, its handler answers unknown ones),
        any one-segment name that is not its protocol's (``/verify``, ``/seed_session``, ...) nor ours."""
        if name in self.tool_names:
            return True
        return (
            self.catch_all
            and _ONE_SEGMENT.fullmatch(name) is not None
            and f"/{name}" not in _ENDPOINTS
            and not name.startswith(OPERATION_PREFIXES)
        )

    def _build(self) -> Any:
        cls = self.prepare()
        if getattr(cls, "ray_enabled", None) is True:
            # as run_webserver does before serving: Ray's start takes tens of seconds, which inside the first
            # verify's `.remote()` call would hold that verify (and every request behind it) so long
            from nemo_gym.server_utils import initialize_ray

            initialize_ray()
        config = cls.model_fields["config"].annotation.model_validate(self.fields)  # type: ignore[attr-defined]
        client = server_client(self, self.global_config)
        self._wrap_shared_session()
        self.instance = cls(config=config, server_client=client)
        app = self.instance.setup_webserver()
        lighten(app, self.instance)
        self.app = app
        return app

    async def stop(self) -> None:
        if self._life is not None:
            await self._life.stop()
        if self.called is not None:
            await self.called.close_all()

    def _wrap_shared_session(self) -> None:
        """NeMo Gym's one aiohttp session (built from the global config as it would be), wrapped so that
        requests to our models' hosts go over the bus (``url_call``) and any other goes out unchanged."""
        from nemo_gym import server_utils

        inner = server_utils.get_global_aiohttp_client()
        if not isinstance(inner, _BusSession):
            server_utils._GLOBAL_AIOHTTP_CLIENT = _BusSession(self, inner)
        _route_httpx(self)
        _route_requests(self)

    async def post(self, jar: Jar, path: str, body: bytes) -> tuple[int, bytes]:
        """``POST path`` with a JSON body to the app, on its loop, with and into one rollout's cookies."""
        assert self.loop is not None, "the hosted server is not started"
        status, cookies, out = await self.loop.run(self._request(path, body, jar.header()))
        if cookies:
            jar.update(cookies)
        return status, out

    async def _request(self, path: str, body: bytes, cookie: bytes | None) -> tuple[int, list[bytes], bytes]:
        _CURRENT.set(self)  # this task's own context: the server's clients' calls while it runs are ours
        mark = ENV_THREAD.get()  # in a guest: the app loop's thread is noted as this call's while it runs its code
        coro = request(self.app, path, body, cookie)
        return await (ThreadMarked(coro, mark) if mark is not None else coro)

    def tool_definitions(self) -> list[dict[str, Any]]:
        """Function tools from the app's routes: each ``POST /<tool>`` with its body's JSON schema (from the app's
        OpenAPI schema: ~1.8 CPU-s for a NeMo Gym app, whose verify models hold the Responses API's, so made only
        where a caller asks for the schemas; the tools' names come from the routes, ``_post_paths``)."""
        spec = self.app.openapi()
        comps = spec.get("components", {}).get("schemas", {})
        tools = []
        for path, ops in spec.get("paths", {}).items():
            post = ops.get("post")
            if post is None or not _is_tool_path(path):
                continue
            schema = post.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
            params = _resolve(schema, comps) if schema else {"type": "object", "properties": {}}
            params.pop("title", None)
            tools.append(
                {
                    "type": "function",
                    "name": path.lstrip("/"),
                    "description": post.get("description", ""),
                    "parameters": params,
                }
            )
        return tools

    async def answer(self, server_name: str, url_path: str, method: str, kwargs: dict[str, Any]) -> Any:
        """A call by name of the server's ``server_client`` (``server_client.Answers``): a model the config names
        over the bus, a resource it names through its session; any other, ``NOT_MINE`` (HTTP, as NeMo Gym)."""
        if server_name in self.model_names:
            return await self.model_call(server_name, url_path, kwargs.get("json"))
        if server_name in self.resource_names:
            return await self.resource_call(server_name, url_path, kwargs.get("json"), kwargs.get("cookies"))
        return NOT_MINE

    async def model_call(self, server_name: str, url_path: str, body: Any) -> _Reply:
        """A server's call to a model: that model's workers over the bus, in the Responses API
        (``/v1/responses``) or Chat Completions (``/v1/chat/completions``, converted both ways)."""
        call = thread_call() or ENV_CALL.get()  # in a guest: the call whose request this is (its trace)
        return await on_loop(self.bus_loop, in_call(call, self._model_call(server_name, url_path, plain(body))))

    async def _model_call(self, server_name: str, url_path: str, body: Any) -> _Reply:
        self.calls[server_name] = self.calls.get(server_name, 0) + 1
        if self.models is None:
            return _error(503, "no model client in this worker")
        path = url_path.partition("?")[0].rstrip("/")
        raw = dict(body or {})
        raw.pop("model", None)
        raw.pop("stream", None)
        try:
            if path.endswith("/responses"):
                if isinstance(raw.get("input"), str):
                    raw["input"] = [{"role": "user", "content": raw["input"]}]
                resp = await self.models.generate(create_params(raw), model=server_name)
                return _Reply(200, msgspec.json.encode(resp))
            if path.endswith("/chat/completions"):
                resp = await self.models.generate(chat_body_to_params(raw), model=server_name)
                return _Reply(200, json.dumps(response_to_chat(resp, server_name)).encode())
        except Failure as e:  # the model's own error class, as an HTTP error NeMo Gym's judges handle
            status = 400 if e.info.error_class == "invalid_task" else 502
            return _error(status, f"{e.info.error_class}: {e.info.message}")
        msg = f"{url_path}: hosted servers reach models at /v1/responses and /v1/chat/completions"
        return _error(404, msg)

    async def url_call(self, host: str, method: str, url_path: str, body: Any) -> _Reply:
        """A request of the server's own client to one of our hosts (``url_call`` of ``_BusSession``)."""
        name, _, domain = host.partition(".")
        if domain == MODELS_DOMAIN and name in self.model_names and method.upper() == "POST":
            return await self.model_call(name, url_path, body)
        if domain == RESOURCES_DOMAIN and name in self.resource_names:
            return await self.resource_call(name, url_path, body, {})
        return _error(404, f"{method} http://{host}{url_path}: no model or resources server of the config here")

    async def sandbox_call(self, call: SandboxCall) -> SandboxReply:
        """A sandbox operation of the server's code (``hosting.sandbox_provider``), made by the worker."""
        if self.sandboxes_via is None:
            raise RuntimeError(
                f"resources.{self.name}: sandbox_provider: {SANDBOX_PROVIDER} needs the entry's isolation: process "
                "(the default) and a sandbox pool (resources.NAME.sandbox)"
            )
        return await on_loop(self.bus_loop, self.sandboxes_via(call))

    async def resource_call(self, server_name: str, url_path: str, body: Any, cookies: Any) -> _Reply:
        """A server's call to another resources server by name: a session of ours on its workers."""
        token = _cookie(cookies, SESSION_COOKIE) or ""
        return await on_loop(self.bus_loop, self._resource_call(server_name, url_path, plain(body), token))

    async def _resource_call(self, server_name: str, url_path: str, body: Any, token: str) -> _Reply:
        self.calls[server_name] = self.calls.get(server_name, 0) + 1
        if self.resources_via is not None:  # in a guest process: the worker makes the call over its bus
            return await self.resources_via(server_name, url_path, body, token)
        if self.called is None:
            return _error(503, "no bus in this worker")
        return await self.called.call(server_name, url_path, body, token)


class CalledSessions:
    """A hosted server's sessions on other resources servers (its calls to them by name), over ``bus``; kept by
    the cookie value that names each. In the worker's own process (a hosted server in a guest sends its calls
    here over the guest wire) or in the server's (``isolation: none``)."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.sessions: dict[str, Session] = {}

    async def close_all(self) -> None:
        for session in list(self.sessions.values()):
            await session.close()
        self.sessions.clear()

    async def answer(self, server_name: str, url_path: str, body: Any, token: str) -> tuple[int, bytes, str]:
        """``call`` as a guest's call is answered over the guest wire: status, body, the session's token."""
        reply = await self.call(server_name, url_path, body, token)
        return reply.status, await reply.read(), _cookie(reply.cookies, SESSION_COOKIE) or ""

    async def call(self, server_name: str, url_path: str, body: Any, token: str) -> _Reply:
        path = url_path.partition("?")[0]
        row = dict(body or {})
        try:
            response = msgspec.convert(row.pop("response", None), Response) if path == "/verify" else None
        except msgspec.ValidationError as e:
            return _error(422, f"{server_name}{path}: response: {e}")
        session = self.sessions.get(token)
        if path == "/seed_session" or session is None:
            # no session yet: a fresh one, seeded with the row (a verify's: seeded then verified, as reverify does)
            token = f"{server_name}.{os.urandom(8).hex()}"
            seed_row = row if path in ("/seed_session", "/verify") else {}
            session = Session(self.bus, server_name, seed_row)
            self.sessions[token] = session
            while len(self.sessions) > MAX_CALLED_SESSIONS:  # seeded but never verified: the oldest goes
                await self.sessions.pop(next(iter(self.sessions))).close()
        jar = {SESSION_COOKIE: token}
        try:
            if path == "/seed_session":  # sent with the session's first operation, as every seed is
                return _Reply(200, b"{}", jar)
            if response is not None:
                verdict = await session.verify(row, response, timeout=CALL_TIMEOUT_S)
                self.sessions.pop(token, None)  # verify closes the session
                posted = {**row, "response": _response_dict(response), "reward": verdict.reward}
                # the environment's fields, then the posted keys: its fields never replace them (``rowkeys``)
                fields = own_fields(verdict.fields, posted, posted, who=f"{server_name}'s verify")
                return _Reply(200, json.dumps({**posted, **fields}).encode(), jar)
            if path.count("/") == 1 and path not in _ENDPOINTS:
                reply = await session.call(path[1:], json.dumps(row), timeout=CALL_TIMEOUT_S)
                return _Reply(500 if reply.is_error else 200, reply.output.encode(), jar)
        except Failure as e:
            self.sessions.pop(token, None)
            return _error(502, f"{server_name}{path}: {e.info.error_class}: {e.info.message}")
        return _error(404, f"{server_name}{path}: not served to other servers (seed_session, verify, tools)")


def _server_class(module: Any, base: type) -> type:
    found = [
        v
        for v in vars(module).values()
        if isinstance(v, type) and issubclass(v, base) and v.__module__ == module.__name__
    ]
    if not found:
        raise UserError(f"{module.__name__}: no NeMo Gym server class defined there")
    # the most derived one (an app module may define a base and its subclass)
    return next(c for c in found if not any(o is not c and issubclass(o, c) for o in found))


def _resolve(node: Any, comps: dict[str, Any], depth: int = 0) -> Any:
    if depth > 20:
        return {}
    if isinstance(node, dict):
        if "$ref" in node and isinstance(node["$ref"], str):
            return _resolve(dict(comps.get(node["$ref"].rsplit("/", 1)[-1], {})), comps, depth + 1)
        return {k: _resolve(v, comps, depth + 1) for k, v in node.items()}
    if isinstance(node, list):
        return [_resolve(v, comps, depth + 1) for v in node]
    return node


async def _post(host: ServerHost, jar: Jar, path: str, body: Any) -> Any:
    """A protocol call (seed, verify, reset, step): its JSON reply, or ``HostedServerError`` on an error status."""
    status, out = await host.post(jar, path, msgspec.json.encode(body))
    if status >= 400:
        raise HostedServerError(f"{path}: HTTP {status}: {out[:500].decode(errors='replace')}")
    return msgspec.json.decode(out)


def _response_dict(response: Response) -> dict[str, Any]:
    """Our Response as NeMo Gym's schema requires it (output item ids, statuses and annotations filled in)."""
    out = msgspec.to_builtins(response)
    out["output"] = _output_items(out.get("output") or [])
    return out


def _output_items(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    fixed = []
    for i, item in enumerate(items):
        item = dict(item)
        kind = item.get("type")
        if kind in ("message", "function_call", "reasoning") and not item.get("id"):
            item["id"] = f"{kind[:3]}_{i}"
        if kind in ("message", "function_call") and item.get("status") is None:
            item["status"] = "completed"
        if kind == "message" and isinstance(item.get("content"), list):
            item["content"] = [
                {"annotations": [], **part} if part.get("type") == "output_text" else part for part in item["content"]
            ]
        fixed.append(item)
    return fixed


def _one_line(e: BaseException) -> str:
    """An exception as one line: its type and its message's first line with words (NLTK's open with stars)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip().strip("*")]
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


class _Hosted:
    """What both hosted classes share: the server starts with the worker and offers its routes as tools."""

    host: ClassVar[ServerHost]
    options: ClassVar[dict[str, Any]]
    jar: Jar  # the rollout's cookies (its NeMo Gym session), made by its seed

    @classmethod
    async def setup(cls, options: dict[str, Any]) -> None:
        cls.options = options
        try:
            await cls.host.start()
        except UserError:
            raise
        except Exception as e:  # its own start-up code (rolemrc: NLTK corpora it would download): one line
            server = f"{cls.host.name} ({cls.host.impl or '?'})"
            raise UserError(f"hosted server {server} cannot start here: {_one_line(e)}") from None

    @classmethod
    async def teardown(cls) -> None:
        await cls.host.stop()

    @classmethod
    def tool_definitions(cls) -> list[dict[str, Any]]:
        return cls.host.tool_definitions()


class HostedResource(_Hosted, Resource):
    """A NeMo Gym server's session (``host`` is set on the class made by ``hosted_class``)."""

    row_tools = "any"  # the rows' tools are the server's routes; the server itself answers unknown ones
    reverify = "replay"
    seeded: Any = None  # the server's reply to /seed_session (what a hosted agent's own /seed_session gets)

    async def seed(self, task: dict[str, Any]) -> None:
        self.host.models = self.models
        self.jar = Jar()
        self.seeded = await _post(self.host, self.jar, "/seed_session", _as_request(task))

    async def call_tool(self, name: str, arguments: str | bytes) -> str:
        if not self.host.is_tool(name):  # /verify, /seed_session, ... and paths that are no route
            return NOT_FOUND.decode()
        body = arguments.encode() if isinstance(arguments, str) else arguments
        _, out = await self.host.post(self.jar, f"/{name}", body or b"{}")
        return out.decode(errors="replace")  # NeMo Gym's simple agent shows the model the body, a 500's repr(e) too

    async def call_operation(self, op: str, arguments: str | bytes) -> str:
        if op == PASSTHROUGH:
            return await self._passthrough(arguments)
        return await super().call_operation(op, arguments)

    async def _passthrough(self, arguments: str | bytes) -> str:
        """``{"path", "body"}`` posted to the server as it is; ``{"status", "body"}`` (the body as text) back.
        ``/seed_session`` is not posted again: the session was seeded with the agent's row when it opened."""
        try:
            req = json.loads(arguments)
            path = req["path"]
        except (ValueError, TypeError, KeyError):
            raise ToolArgumentsError(f"{PASSTHROUGH}: arguments must be {{path, body}}") from None
        if not isinstance(path, str) or not path.startswith("/") or path.startswith("//"):
            raise ToolArgumentsError(f"{PASSTHROUGH}: path must be a server path, not {path!r}")
        if path == "/seed_session":
            return json.dumps({"status": 200, "body": json.dumps(self.seeded)})
        status, out = await self.host.post(self.jar, path, msgspec.json.encode(req.get("body")))
        return json.dumps({"status": status, "body": out.decode(errors="replace")})

    async def verify(self, task: dict[str, Any], response: Response) -> Verdict:
        task = dict(task)
        extra = task.pop(RESPONSE_EXTRA, None) or {}
        out = await _post(
            self.host, self.jar, "/verify", {**_as_request(task), "response": {**_response_dict(response), **extra}}
        )
        return _verdict(out)


def _as_request(task: dict[str, Any]) -> dict[str, Any]:
    """A task row as the server's request model takes it. NeMo Gym's rollout files dump
    ``responses_create_params`` with every unset field as null, and its request model refuses some of those
    nulls (``parallel_tool_calls``, ``tool_choice``: HTTP 422); a field left out means what it meant when
    the row was recorded (its default), so a recorded row re-verifies (``reverify``)."""
    params = task.get("responses_create_params")
    if not isinstance(params, dict) or None not in params.values():
        return task
    return {**task, "responses_create_params": {k: v for k, v in params.items() if v is not None}}


def _verdict(out: dict[str, Any]) -> Verdict:
    return Verdict(reward=float(out.get("reward") or 0.0), fields={k: v for k, v in out.items() if k not in _ECHOED})


class HostedGymResource(_Hosted, GymResource):
    """A gymnasium-style NeMo Gym server (``/reset`` + ``/step``) as a ``GymResource``."""

    row_tools = "any"

    async def seed(self, task: dict[str, Any]) -> None:
        await super().seed(task)
        self.host.models = self.models
        self.jar = Jar()

    async def reset(self, task: dict[str, Any]) -> Reset:
        out = await _post(self.host, self.jar, "/reset", task)
        return Reset(observation=out.get("observation"), info=out.get("info") or {})

    async def step(self, action: Action) -> Step:
        response = {
            "id": f"step-{action.turn}",
            "created_at": 0,
            "model": "",
            "object": "response",
            "output": _output_items(msgspec.to_builtins(action.output)),
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
        }
        out = await _post(self.host, self.jar, "/step", {**self.task, "response": response})
        return Step(
            observation=out.get("observation"),
            reward=float(out.get("reward") or 0.0),
            terminated=bool(out.get("terminated")),
            truncated=bool(out.get("truncated")),
            info=out.get("info") or {},
        )

    async def call_tool(self, name: str, arguments: str | bytes) -> str:
        return await HostedResource.call_tool(self, name, arguments)  # type: ignore[arg-type]

    async def call_operation(self, op: str, arguments: str | bytes) -> str:
        if op == PASSTHROUGH:  # its agents reach it through /reset and /step, our gym operations
            raise ToolArgumentsError(f"{PASSTHROUGH}: a gymnasium server is reached through gym.reset and gym.step")
        return await super().call_operation(op, arguments)


def hosted_class(host: ServerHost) -> type[Resource]:
    """The Resource class of a hosted server for one worker (``host``, built by its ``setup``); the host's
    calls to its ``model_names`` and ``resource_names`` by name go over its ``bus``."""
    server, name = host.server, host.name
    try:
        import nemo_gym  # noqa: F401
    except ImportError:
        raise UserError(
            f"resources.{name}: the hosted NeMo Gym server {server!r} runs in its built environment, which "
            "`gym-runtime start`/`run` start its workers in (this command runs workers in its own process)"
        ) from None
    host.prepare()
    base: type[Resource] = HostedGymResource if host.gymnasium else HostedResource
    return type(f"Hosted_{Path(server).name}", (base,), {"host": host, "__module__": __name__})
