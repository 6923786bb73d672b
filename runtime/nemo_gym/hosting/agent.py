"""A NeMo Gym agent server's own code (``simple_agent``, ...), in process, as a gym-runtime agent.

Chosen with ``agents.NAME.nemo_gym: AGENT`` (instead of ``agent:``); the config's ``model``
and ``resource`` are the agent's ``model_server`` and ``resources_server``, ``max_steps`` its
``max_steps``, ``options`` its other config fields. The agent class is built as NeMo Gym's
``run_webserver`` builds it, minus the port, and each rollout is one ``POST /run`` (one minimal
ASGI request, ``hosting.asgi``) with the task's row as the body: the agent's own handler runs
unchanged. The app, its lifespan and every task its code starts run on the process's app loop
(``hosting.asgi.AppLoop``; the main thread in a hosted worker's process), never on the worker's
bus loop: an agent that blocks its loop (synchronous code in its handler) delays its own
rollouts, not the worker's keepalives or the replies to its other rollouts' calls. What the
handler asks of the bus (models, the resource) hops to the bus loop and back; cancelling a
rollout cancels its ``/run``.

Its ``server_client`` calls by name are routed here instead of over HTTP:

* the agent's own name (its ``/run`` calling its ``/v1/responses``): the same app, on its loop;
* a model the config names: that model's workers over the bus (``AgentContext.generate``:
  policy versions, token ids, retries, traces as for any agent);
* the agent's resource: the rollout's one ``Session`` (hosted or native resource workers),
  in place of NeMo Gym's cookie: ``/seed_session`` opens it with the row (sent with the first
  operation, as every session's seed is; the reply is ``{}``), ``/<tool>`` is a ``ToolCall`` with
  the posted arguments, ``/verify`` a ``VerifyRequest`` with the posted response, ``/reset`` and
  ``/step`` our ``GymResource`` operations (``gym.reset``, ``gym.step`` with the turn as an
  ``Action``), ``/close`` nothing (the session closes when the rollout ends);
* a hosted resource that is not a gymnasium server: ``/seed_session`` answers the server's own
  seed reply, and ``/step``, ``/reset`` and ``/close`` are posted to the server unchanged (one
  ``PASSTHROUGH`` session op each), so an agent speaking its server's own protocol
  (``toolsandbox_agent``: ``env_id`` from the seed reply, ``/step`` and ``/close`` by it) runs
  as under NeMo Gym; its ``/verify`` carries the response's fields our ``Response`` drops
  (``response.env_id``) to the server's verify. Tools stay our ``ToolCall``s;
* a request that carries out one of the model's function calls (``/NAME`` with that call's
  arguments, as NeMo Gym's simple agent posts it) is a tool call whatever ``NAME`` is: a model
  calling ``verify`` reaches the resource's answer to an unknown tool, never its ``/verify``.

Which rollout a call belongs to is a context variable set in the app-loop task that makes the
``/run`` call: the handler runs in that task, and tasks it starts copy its context. A bus
failure inside the handler (a tool or verify error class) is re-raised as itself after
``/run`` returns, so the row has our error class, not the agent's HTTP 500.

Imported everywhere (config checks load it by name); nemo-gym and fastapi are imported only
when an agent is built, which happens in the agent's built environment.
"""

from __future__ import annotations

import asyncio
import contextvars
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import anyio
import msgspec

from gym_runtime.agent import AgentContext, Outcome, Session, current_repeat, in_repeat
from gym_runtime.config import AgentConfig
from gym_runtime.data.rowkeys import own_fields
from gym_runtime.errors import Failure, UserError
from gym_runtime.gymnasium import RESET, STEP, Action
from gym_runtime.messages import (
    ErrorClass,
    FunctionCall,
    Response,
    VerifyReply,
    create_params,
    output_text,
    parse_items,
)
from gym_runtime.nemo_gym.hosting.asgi import AppLife, AppLoop, app_loop, on_loop, request
from gym_runtime.nemo_gym.hosting.host import (
    MODEL_HOST,
    PASSTHROUGH,
    RESPONSE_EXTRA,
    HostedServerError,
    _Reply,
    _server_class,
    plain,
)
from gym_runtime.nemo_gym.hosting.middleware import lighten
from gym_runtime.nemo_gym.hosting.server_client import server_client

_ECHOED = ("responses_create_params", "response", "reward")


_UNPARSED = object()  # arguments that are not JSON: equal to no body


def _parsed(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return _UNPARSED


class _Rollout:
    """One rollout's routing state: its context, its resource session, what the resource answered."""

    __slots__ = ("ctx", "row", "session", "verdict", "error", "turns", "passthrough", "calls", "repeat")

    def __init__(self, ctx: AgentContext, row: dict[str, Any], session: Session) -> None:
        self.ctx = ctx
        self.row = row  # the body of its /run (a group's repeat carries its own indices)
        self.repeat = current_repeat()  # a group's repeat: its calls are its own (its failure row's partial, cost)
        self.session = session
        self.verdict: VerifyReply | None = None
        self.error: BaseException | None = None
        self.turns = 0  # gymnasium steps so far
        self.passthrough = False  # a hosted, non-gymnasium resource: its own protocol's paths go to it as sent
        self.calls: list[tuple[str, Any]] = []  # the latest model turn's function calls not yet carried out

    def policy_call(self, url_path: str, body: Any) -> str | None:
        """The model's function call that a request to the resource carries out, if it is one: the agent posts
        ``/NAME`` with the call's arguments (NeMo Gym's simple agent does). Such a request is a tool call,
        whatever its name: a model calling ``verify`` reaches no /verify (an oracle of its reward)."""
        for i, (name, arguments) in enumerate(self.calls):
            if url_path == f"/{name}" and arguments == body:
                del self.calls[i]
                return name
        return None


_CURRENT: contextvars.ContextVar[_Rollout | None] = contextvars.ContextVar("gym_hosted_agent_rollout", default=None)


def _yaml_defaults(adir: Path, impl: str) -> dict[str, Any]:
    """The agent's own config fields from its ``configs/*.yaml`` (the first block naming it)."""
    import yaml

    for path in sorted((adir / "configs").glob("*.yaml")):
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError:
            continue
        for inst in data.values() if isinstance(data, dict) else []:
            block = inst.get("responses_api_agents", {}).get(impl) if isinstance(inst, dict) else None
            if isinstance(block, dict):
                return {k: v for k, v in block.items() if not (isinstance(v, str) and ("${" in v or v == "???"))}
    return {}


class AgentHost:
    """One NeMo Gym agent class, built once per worker process; ``run`` is the worker's agent function."""

    def __init__(self, name: str, cfg: AgentConfig, model_names: list[str], resource_hosted: bool = False) -> None:
        self.name = name
        self.cfg = cfg
        self.model_names = list(model_names)
        self.resource_hosted = resource_hosted  # its resource is a hosted NeMo Gym server (may pass through)
        self.app: Any = None
        self.impl = ""
        self.bus_loop: asyncio.AbstractEventLoop | None = None  # the worker's: what the handler asks of the bus
        self.loop: AppLoop | None = None  # the app's own
        self._life: AppLife | None = None  # the app's life on its loop, lifespan included

    def _agent_dir(self) -> Path:
        path = Path(self.cfg.nemo_gym)
        if path.is_dir():
            return path.resolve()
        import responses_api_agents

        found = Path(next(iter(responses_api_agents.__path__))) / self.cfg.nemo_gym
        if not (found / "app.py").is_file():
            raise UserError(f"agents.{self.name}.nemo_gym: no NeMo Gym agent server named {self.cfg.nemo_gym!r}")
        return found

    def _fields(self, adir: Path) -> dict[str, Any]:
        fields = {**_yaml_defaults(adir, self.impl), **self.cfg.options}
        fields["model_server"] = {"type": "responses_api_models", "name": self.cfg.model}
        if self.cfg.resource:
            fields["resources_server"] = {"type": "resources_servers", "name": self.cfg.resource}
        if self.cfg.max_steps is not None:
            fields["max_steps"] = self.cfg.max_steps
        fields.update(entrypoint="app.py", name=self.name, host="127.0.0.1", port=0)
        return fields

    async def setup(self, _cfg: AgentConfig) -> None:
        """Build the agent on the app's loop as NeMo Gym's run_webserver does, minus the port; enter its
        lifespan there (left by ``stop``). An error building it is raised here."""
        self.bus_loop = asyncio.get_running_loop()
        self.loop = app_loop()
        self._life = AppLife(self.loop, self._build)
        await self._life.start()

    async def stop(self) -> None:
        """The agent's lifespan left, on the app's loop (the worker stops)."""
        if self._life is not None:
            await self._life.stop()

    def _build(self) -> Any:
        import yaml
        from nemo_gym.server_utils import SimpleServer

        adir = self._agent_dir()
        self.impl = adir.name
        if str(adir.parent.parent) not in sys.path:
            sys.path.append(str(adir.parent.parent))
        if str(adir) not in sys.path:
            sys.path.insert(0, str(adir))
        fields = self._fields(adir)
        here = {"host": MODEL_HOST, "port": 80, "entrypoint": "-"}
        global_config: dict[str, Any] = {
            "head_server": {"host": "127.0.0.1", "port": 0},
            **{m: {"responses_api_models": {"gym_runtime": here}} for m in self.model_names},
            self.name: {"responses_api_agents": {self.impl: fields}},
        }
        if self.cfg.resource:
            global_config[self.cfg.resource] = {"resources_servers": {"gym_runtime": here}}
        os.environ["NEMO_GYM_CONFIG_DICT"] = yaml.safe_dump(global_config)
        os.environ["NEMO_GYM_CONFIG_PATH"] = self.name
        module = importlib.import_module(f"{adir.parent.name}.{self.impl}.app")
        cls = _server_class(module, SimpleServer)
        config = cls.model_fields["config"].annotation.model_validate(fields)  # type: ignore[attr-defined]
        instance = cls(config=config, server_client=server_client(self, global_config))
        app = instance.setup_webserver()
        lighten(app, instance)
        self.app = app
        return app

    async def run(self, ctx: AgentContext) -> Outcome:
        """One rollout: ``POST /run`` with the row and its ``_ng_task_index``/``_ng_rollout_index`` (as NeMo Gym's
        runner sends them, where the row has none); the row that comes back is built from our replies."""
        task = ctx.task
        return await self._run_one(
            ctx, {"_ng_task_index": task.task_index, "_ng_rollout_index": task.rollout_index, **ctx.row}
        )

    async def run_group(self, ctx: AgentContext, size: int) -> list[Outcome]:
        """A group task's K repeats as NeMo Gym's own runner sends them: K concurrent ``/run`` calls, each
        row with its ``_ng_task_index`` and ``_ng_rollout_index``, each in its own session. Concurrent, so a
        server that scores a task's repeats together (a cohort held until all K verified, as
        genrm_compare's) sees all K; one outcome per repeat; one failing repeat fails the group (redelivered
        or failure rows as a whole), after its siblings finished."""
        task = ctx.task
        outcomes: list[Outcome | None] = [None] * size
        errors: list[BaseException] = []

        async def one(i: int) -> None:
            row = {**ctx.row, "_ng_task_index": task.task_index, "_ng_rollout_index": task.rollout_index + i}
            try:
                with ctx.repeat(i):  # its calls are its own: a failed group's rows each keep their repeat's
                    outcomes[i] = await self._run_one(ctx, row)
            except Exception as e:
                errors.append(e)

        async with anyio.create_task_group() as tg:
            for i in range(size):
                tg.start_soon(one, i)
        if errors:
            raise errors[0]
        return [o for o in outcomes if o is not None]

    async def _run_one(self, ctx: AgentContext, row: dict[str, Any]) -> Outcome:
        assert self.loop is not None, "the hosted agent is not set up"
        async with await ctx.open_session(row=row) as session:
            rollout = _Rollout(ctx, row, session)
            status, out = await self.loop.run(self._post_run(rollout, msgspec.json.encode(row)))
        if rollout.error is not None:
            raise rollout.error
        if status >= 400:
            kind: ErrorClass = "invalid_task" if status == 422 else "internal"
            raise Failure(kind, f"{self.cfg.nemo_gym} /run: HTTP {status}: {out[:500].decode(errors='replace')}")
        result: dict[str, Any] = msgspec.json.decode(out)
        response = msgspec.convert(result.get("response") or {}, Response, strict=False)
        verdict = rollout.verdict
        if verdict is None:  # the agent skipped verification (skip_verification): its own reward
            extras = {k: v for k, v in result.items() if k not in _ECHOED and k not in row}
            verdict = VerifyReply(reward=float(result.get("reward") or 0.0), fields=extras)
        return Outcome(response=response, verdict=verdict)

    async def _post_run(self, rollout: _Rollout, body: bytes) -> tuple[int, bytes]:
        """On the app's loop: ``POST /run``, in a task whose context (and so its handler's, and the tasks the
        handler starts) names the rollout."""
        _CURRENT.set(rollout)
        status, _, out = await request(self.app, "/run", body, None)
        return status, out

    async def answer(self, server_name: str, url_path: str, method: str, kwargs: dict[str, Any]) -> _Reply:
        """Every call by name of the hosted agent's ``server_client`` (``server_client.Answers``): routed."""
        return await self.route(server_name, url_path, method, plain(kwargs.get("json")))

    async def route(self, server_name: str, url_path: str, method: str, body: Any) -> _Reply:
        """A ``server_client`` call by name, made by the handler on the app's loop: the agent itself (on that
        loop), or a model or the rollout's resource session (on the bus loop, and back)."""
        assert self.loop is not None, "the hosted agent is not set up"
        if server_name == self.name:
            call = request(self.app, url_path, msgspec.json.encode(body), None, method.upper())
            status, _, out = await on_loop(self.loop.loop, call)
            return _Reply(status, out)
        rollout = _CURRENT.get()
        if rollout is None:
            return _Reply(500, json.dumps(f"{server_name}{url_path}: called outside a rollout").encode())
        return await on_loop(self.bus_loop, self._on_bus(rollout, server_name, url_path, body))

    async def _on_bus(self, rollout: _Rollout, server_name: str, url_path: str, body: Any) -> _Reply:
        """A call to a model or the resource, on the bus loop (the rollout's context and session live there), as its
        repeat's (a task of its own there: the repeat ``run_group`` named is set again)."""
        try:
            with in_repeat(rollout.repeat):
                if server_name in self.model_names:
                    return await self._model(rollout, server_name, url_path, body)
                if server_name == self.cfg.resource:
                    return await self._resource(rollout, url_path, body)
        except Exception as e:  # our error class, re-raised by run() after the handler answers
            rollout.error = e
            raise
        msg = f"{server_name}{url_path}: not a model or the resource of agents.{self.name}"
        return _Reply(501, json.dumps(msg).encode())

    async def _model(self, rollout: _Rollout, server_name: str, url_path: str, body: Any) -> _Reply:
        if not url_path.endswith("/v1/responses"):
            msg = f"{url_path}: hosted agents reach models through the Responses API only (/v1/responses)"
            return _Reply(501, json.dumps(msg).encode())
        raw = dict(body or {})
        raw.pop("model", None)
        if isinstance(raw.get("input"), str):
            raw["input"] = [{"role": "user", "content": raw["input"]}]
        resp = await rollout.ctx.generate(create_params(raw), model=server_name)
        rollout.calls = [(o.name, _parsed(o.arguments)) for o in resp.output if isinstance(o, FunctionCall)]
        return _Reply(200, msgspec.json.encode(resp))

    async def _resource(self, rollout: _Rollout, url_path: str, body: Any) -> _Reply:
        called = rollout.policy_call(url_path, body)
        if called is not None:  # reaches only a tool the resource declares, never its protocol
            reply = await rollout.session.call(called, json.dumps(body))
            return _Reply(200, reply.output.encode())
        path = url_path.split("?", 1)[0].rstrip("/")
        path = "/" + path.rsplit("/", 1)[-1] if path.startswith("/ng-rollout/") else path
        if path == "/seed_session":
            if self.resource_hosted:  # its own seed reply (env_id, observations, tools), unless a gymnasium server
                return await self._passthrough(rollout, path, body)
            return _Reply(200, b"{}")  # the seed (the task's row) travels with the session's first operation
        if rollout.passthrough and path in ("/reset", "/step", "/close"):
            return await self._passthrough(rollout, path, body)
        if path == "/verify":
            row = dict(body or {})
            posted = row.pop("response", None) or {}
            response = msgspec.convert(posted, Response, strict=False)
            extra = {k: v for k, v in posted.items() if k not in Response.__struct_fields__}
            seed = {**rollout.row, RESPONSE_EXTRA: extra} if rollout.passthrough and extra else rollout.row
            verdict = await rollout.session.verify(seed, response)
            posted_body = dict(body or {})
            try:  # the environment's fields, then the runtime's keys: its fields never replace them (``rowkeys``)
                mine = {**rollout.row, "reward": verdict.reward}  # the row it verified: an echo of it is none
                fields = own_fields(verdict.fields, mine, posted_body, who="the environment's verify")
            except Failure as e:
                rollout.error = e
                return _Reply(500, json.dumps({"detail": e.info.message}).encode())
            rollout.verdict = verdict
            out = {**posted_body, **fields, "reward": verdict.reward}
            return _Reply(200, json.dumps(out).encode())
        if path == "/reset":  # a GymResource episode (hosted /reset + /step servers, or a native one)
            rollout.turns = 0
            return _Reply(200, (await self._gym(rollout, RESET, "{}")).encode())
        if path == "/step":
            items = parse_items((body or {}).get("response", {}).get("output") or [])
            rollout.turns += 1
            action = Action(text=output_text(items), output=items, turn=rollout.turns)
            return _Reply(200, (await self._gym(rollout, STEP, msgspec.json.encode(action).decode())).encode())
        if path == "/close":
            return _Reply(200, b"{}")  # the session closes when the rollout ends
        if path in ("/aggregate_metrics", "/close_session"):
            return _Reply(501, json.dumps(f"{path}: not routed for hosted agents").encode())
        reply = await rollout.session.call(path.lstrip("/"), json.dumps(body if body is not None else {}))
        return _Reply(200, reply.output.encode())

    async def _passthrough(self, rollout: _Rollout, path: str, body: Any) -> _Reply:
        """The agent's call posted to its hosted server as sent; the server's status and body as they are. A
        gymnasium server refuses (its /reset and /step are our gym operations): the seed reply is then ``{}``.
        A server error (5xx) on the server's own protocol fails the rollout as a tool_error."""
        reply = await rollout.session.operate(PASSTHROUGH, json.dumps({"path": path, "body": body}))
        if reply.is_error:
            if path == "/seed_session":
                return _Reply(200, b"{}")
            raise Failure("tool_error", f"{path}: {reply.output}")
        rollout.passthrough = True
        out = json.loads(reply.output)
        status, text = int(out["status"]), str(out["body"])
        if status >= 500:
            rollout.error = Failure("tool_error", f"{self.cfg.resource}{path}: HTTP {status}: {text[:500]}")
        return _Reply(status, text.encode())

    async def _gym(self, rollout: _Rollout, op: str, arguments: str) -> str:
        reply = await rollout.session.operate(op, arguments)
        if reply.is_error:  # not a GymResource, or its reset/step raised: our tool_error, not a reward 0
            raise Failure("tool_error", f"{op}: {reply.output}")
        return reply.output


def hosted_agent(name: str, cfg: AgentConfig, model_names: list[str], resource_hosted: bool = False) -> AgentHost:
    """The host of agents.NAME's NeMo Gym agent (built by its ``setup``); one line if nemo-gym is absent."""
    try:
        import nemo_gym  # noqa: F401
    except ImportError:
        raise UserError(
            f"agents.{name}: the hosted NeMo Gym agent {cfg.nemo_gym!r} runs in its built environment, which "
            "`gym-runtime start`/`run` start its workers in (this command runs workers in its own process)"
        ) from None
    return AgentHost(name, cfg, model_names, resource_hosted)


async def run(ctx: AgentContext) -> Outcome:
    """Never called: the agent worker runs ``AgentHost.run`` for ``nemo_gym`` agents (this module is their
    ``agent`` so that config checks find a module)."""
    raise Failure("internal", f"agents: {ctx.config.nemo_gym!r} is hosted; its worker runs AgentHost.run")


__all__ = ["AgentHost", "HostedServerError", "hosted_agent"]
