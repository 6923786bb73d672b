"""``agents.verifiers_v1``: a verifiers 0.4 taskset (its Taskset x Harness API, ``verifiers.v1``) run as our tasks.

verifiers 0.4 cannot be installed beside our pins (its ``mcp==2.0.0`` and ``openai<3``), so it runs in its own
built environment (``hosting.env.ensure_verifiers``, ``gym-runtime env build --verifiers``): the worker starts this
module's guest process on that environment's interpreter (``verifiers_version`` below), as a hosted NeMo Gym
server's guest runs on its layer. A config may hold 0.3.x environments (``agents.verifiers_env``) beside these.

In the guest the environment is loaded as verifiers' own runner loads it (``load_environment`` of the env config,
the ``[env]`` table of its TOML, given here as ``options.env``) and held serving (its shared tool servers and its
interception server on loopback) for the guest's life. Each task is one episode, ``env.run_episode``, unchanged:
the harness program, its tools over MCP, the task's stops, metrics and rewards, the env's ``finalize``. The
harness's programs run in verifiers' ``subprocess`` runtime (the default here; the layer's ``uv`` syncs their
scripts from its own wheelhouse, so a rollout never downloads). The model behind the interception server is
ours: a loopback endpoint of this guest whose ``/chat/completions`` calls the agent's model over the worker's bus
(``AgentContext.generate``), routed to its rollout by the trace id verifiers sends with every call.

Config (``agents.NAME``)::

    agent: agents.verifiers_v1
    model: policy
    options: {env: {taskset: {id: my_taskset}, agent: {harness: {id: "null"}}}, sampling: {temperature: 1.0}}

Tasks: a row's ``verifiers.index`` (or ``verifiers.key``, the task's ``key``) names the taskset's task; the
prompt is the task's own. ``rows(count)`` gives rows for the first ``count`` tasks.

Rows: one per trace. A single-agent env's ``--repeats K`` are K independent episodes, as verifiers' ``-r K``.
An env whose episode holds several traces judged together in ``finalize`` (``best-of-n``: the 0.4 form of a
group rubric) runs with ``group_repeats: true`` and ``--repeats`` equal to its traces per episode: one episode,
one row per trace. A row's reward is its trace's (``Trace.reward``: its weighted rewards), its metrics and
rewards are fields; an episode verifiers marks failed (an error in a hook, the harness, a timeout) is a failure
row with its class.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import itertools
import json
import os
import secrets
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from gym_runtime.agent import AgentContext, Outcome
from gym_runtime.chat import chat_body_to_params, chat_to_items, response_to_chat
from gym_runtime.config import AgentConfig
from gym_runtime.errors import Failure, UserError
from gym_runtime.messages import ErrorClass, FunctionCall, Message, Reasoning, Response, Usage, VerifyReply

__all__ = ["Options", "check_options", "dataset_rows", "rows", "run", "run_group", "setup"]

isolation = "process"  # always: its code needs verifiers' own environment, which only its guest runs on
# the verifiers release this code is written for: the worker starts the guest on its built environment
verifiers_version = "0.4.0"

# the variable verifiers reads the loopback endpoint's key from (api_key_var). Its runtimes start the harness's
# programs with this process's environment less every name holding "API_KEY": named so, the key stays here
# (a harness program that read it could call the agent's model under any rollout's trace id)
_KEY_VAR = "GYM_VF_ENDPOINT_API_KEY"
_SESSION = "x-session-id"  # verifiers' per-rollout header: the trace id, the same every turn


class Options(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``agents.NAME.options`` of a verifiers 0.4 agent."""

    env: dict[str, Any]  # verifiers' env config (its TOML's [env] table): taskset.id, agent.harness, id, ...
    sampling: dict[str, Any] = msgspec.field(default_factory=dict)  # verifiers' [sampling]
    model_name: str | None = None  # the model name verifiers sees (default: the agent's model entry)


def check_options(options: dict[str, Any]) -> Options:
    try:
        opts = msgspec.convert(options, Options)
    except msgspec.ValidationError as e:
        raise ValueError(f"options: {e}") from None
    taskset = opts.env.get("taskset")
    if not isinstance(taskset, dict) or not isinstance(taskset.get("id"), str):
        raise ValueError("options.env.taskset.id: the verifiers taskset to run (an installed package's name)")
    return opts


def rows(count: int) -> list[dict[str, Any]]:
    """Rows for the taskset's first ``count`` tasks (their prompts are the tasks' own)."""
    return [{"responses_create_params": {"input": []}, "verifiers": {"index": i}} for i in range(count)]


def dataset_rows(options: dict[str, Any], split: str) -> list[dict[str, Any]]:
    """``gym-runtime prepare -i AGENT=env``: refused with what to write instead. The taskset loads only on its
    own built environment (in the guest), and a taskset may be infinite, so ``prepare`` cannot list it."""
    raise ValueError(
        "a verifiers 0.4 taskset loads only in its own built environment, so prepare cannot list it: give rows"
        ' {"responses_create_params": {"input": []}, "verifiers": {"index": I}} for the tasks to run (the first N:'
        " gym_runtime.agents.verifiers_v1.rows(N); docs/bring-your-environment.md, verifiers 0.4)"
    )


# ------------------------------------------------------------------------ the model


@dataclass
class _Route:
    """One rollout's model calls: its context, the responses (token ids and all) and the first failure ours."""

    ctx: AgentContext
    # the rollout's own context (its call in the guest): its model calls are made in it, not the HTTP handler's
    context: contextvars.Context = field(default_factory=contextvars.copy_context)
    responses: list[Response] = field(default_factory=list)
    error: Failure | None = None


class _Endpoint:
    """Chat Completions on loopback for verifiers' interception server: each call goes to the agent's model over
    the worker's bus with the context of the rollout whose trace id it carries; a caller without the key gets 401."""

    def __init__(self) -> None:
        self.key = secrets.token_urlsafe(24)
        self.routes: dict[str, _Route] = {}
        self.base_url = ""
        self.runner: Any = None

    async def start(self) -> None:
        from aiohttp import web

        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/v1/chat/completions", self._chat)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.base_url = f"http://127.0.0.1:{port}/v1"

    async def _chat(self, request: Any) -> Any:
        from aiohttp import web

        if request.headers.get("authorization") != f"Bearer {self.key}":
            return web.json_response({"error": {"message": "unauthorized"}}, status=401)
        route = self.routes.get(request.headers.get(_SESSION, ""))
        if route is None:
            return web.json_response({"error": {"message": "no rollout with this session id"}}, status=404)
        body = await request.json()
        try:
            call = route.ctx.generate(chat_body_to_params(body))
            resp = await asyncio.get_running_loop().create_task(call, context=route.context)
        except Failure as e:
            if route.error is None:
                route.error = e
            status = 503 if e.info.retryable else 500
            return web.json_response({"error": {"message": e.info.message}}, status=status)
        route.responses.append(resp)
        completion = response_to_chat(resp, str(body.get("model") or ""), reasoning="field")
        if body.get("stream"):  # verifiers' chat harness streams: the whole completion as one chunk, then [DONE]
            return web.Response(body=_events(completion), content_type="text/event-stream")
        return web.json_response(completion)


def _events(completion: dict[str, Any]) -> bytes:
    """A chat completion as server-sent events: one ``chat.completion.chunk`` whose delta is the message."""
    choices = []
    for choice in completion.get("choices") or []:
        delta = dict(choice.get("message") or {})
        if delta.get("tool_calls"):
            delta["tool_calls"] = [{**call, "index": i} for i, call in enumerate(delta["tool_calls"])]
        choices.append({**{k: v for k, v in choice.items() if k != "message"}, "delta": delta})
    chunk = {**completion, "object": "chat.completion.chunk", "choices": choices}
    return b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n"


# ------------------------------------------------------------------------ the env


class _Served:
    """One environment, loaded as verifiers' runner loads it and held serving for the guest's life."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.endpoint = _Endpoint()
        self.env: Any = None
        self.tasks: list[Any] = []  # the taskset's tasks loaded so far (a taskset may be infinite: loaded as needed)
        self._more: Any = iter(())
        self.single = True
        self._holder: asyncio.Task[None] | None = None

    async def start(self) -> None:
        from verifiers.v1.envs.single_agent import SingleAgentEnv
        from verifiers.v1.utils.loaders import load_environment, resolve_env_config

        env_cfg = json.loads(json.dumps(self.options.env))
        for seat in ("agent",):  # verifiers' default runtime is a remote sandbox; ours: its local subprocess one
            agent = env_cfg.setdefault(seat, {})
            if isinstance(agent, dict):
                agent.setdefault("runtime", {"type": "subprocess"})
        try:
            self.env = load_environment(resolve_env_config(env_cfg))
        except (ImportError, ValueError, TypeError) as e:
            raise UserError(f"agents.*.options.env: cannot load the verifiers environment: {e}") from None
        self.single = isinstance(self.env, SingleAgentEnv)  # one trace per episode
        self._more = iter(self.env.taskset)
        await self.endpoint.start()
        os.environ[_KEY_VAR] = self.endpoint.key
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # held by a task of its own for the guest's life: the loop's shutdown cancels it, and it unwinds in order
        self._holder = asyncio.get_running_loop().create_task(self._hold(ready))
        await ready

    async def _hold(self, ready: asyncio.Future[None]) -> None:
        try:
            async with self.env.serving():
                ready.set_result(None)
                await asyncio.Event().wait()
        except BaseException as e:
            if not ready.done():
                ready.set_exception(e)
            raise

    def _load_to(self, count: int) -> None:
        self.tasks.extend(itertools.islice(self._more, max(0, count - len(self.tasks))))

    def task(self, row: dict[str, Any], index: int) -> Any:
        extra = row.get("verifiers")
        extra = extra if isinstance(extra, dict) else {}
        if "key" in extra:
            if not self.env.taskset.bounded:
                raise Failure("invalid_task", "an infinite taskset's tasks are named by verifiers.index, not key")
            self._load_to(2**62)
            found = [t for t in self.tasks if str(t.key) == str(extra["key"])]
            if not found:
                raise Failure("invalid_task", f"the taskset has no task with key {extra['key']!r}")
            return found[0]
        i = extra.get("index", index)
        if isinstance(i, int) and i >= 0:
            self._load_to(i + 1)
        if not isinstance(i, int) or not 0 <= i < len(self.tasks):
            raise Failure("invalid_task", f"verifiers.index {i!r}: the taskset has {len(self.tasks)} tasks")
        return self.tasks[i]

    def context(self, model: str) -> Any:
        from verifiers.v1.clients import EvalClientConfig, ModelContext
        from verifiers.v1.types import Sampling

        client = EvalClientConfig(base_url=self.endpoint.base_url, api_key_var=_KEY_VAR)
        return ModelContext(model=model, client=client, sampling=Sampling(**self.options.sampling))

    async def episode(self, task: Any, ctx: AgentContext, model: str) -> tuple[Any, dict[str, _Route]]:
        """One episode; the routes of its traces (by trace id) carry their model calls."""
        routes: dict[str, _Route] = {}

        def minted(trace: Any) -> None:
            routes[trace.id] = self.endpoint.routes[trace.id] = _Route(ctx)

        try:
            episode = await self.env.run_episode(task, self.context(model), on_trace=minted)
        finally:
            for trace_id in routes:
                self.endpoint.routes.pop(trace_id, None)
        return episode, routes


@functools.lru_cache(maxsize=4)
def _served(options_json: str) -> _Served:
    return _Served(msgspec.convert(json.loads(options_json), Options))


async def _serving(options: Options) -> _Served:
    served = _served(json.dumps(msgspec.to_builtins(options), sort_keys=True))
    if served.env is None:
        await served.start()
    return served


# ------------------------------------------------------------------------------ rows


def _error_class(trace: Any) -> ErrorClass:
    if getattr(trace, "is_timeout", False):
        return "timeout"
    names = {e.type for e in trace.errors}
    if any(e.type == "TaskError" and " scoring" in e.message for e in trace.errors):
        return "verify_error"  # a reward or metric of the task raised (verifiers scores nothing then)
    if names & {"TaskError", "ToolsetError"}:
        return "tool_error"
    if names & {"ProviderError"}:
        return "model_error"
    return "verify_error" if trace.is_completed else "tool_error"


def _items(trace: Any, route: _Route) -> list[Any]:
    """The trace's messages after the prompt as our items; each model turn's last item carries its token ids."""
    from verifiers.v1.dialects.chat import message_to_wire

    wire = [message_to_wire(m) for m in trace.messages]
    first = next((i for i, m in enumerate(wire) if m.get("role") == "assistant"), len(wire))
    items: list[Any] = []
    turns = iter(route.responses)
    for m in wire[first:]:
        before = len(items)
        items.extend(chat_to_items([m]))
        if m.get("role") != "assistant" or len(items) == before:
            continue
        resp = next(turns, None)
        done = [i for i in (resp.output if resp else []) if isinstance(i, (Message, FunctionCall, Reasoning))]
        done = [i for i in done if i.generation_token_ids]
        last = items[-1]
        if done and isinstance(last, (Message, FunctionCall, Reasoning)):
            last.prompt_token_ids = done[-1].prompt_token_ids
            last.generation_token_ids = done[-1].generation_token_ids
            last.generation_log_probs = done[-1].generation_log_probs
    return items


def _outcome(trace: Any, route: _Route, model: str) -> Outcome:
    if route.error is not None:
        raise route.error
    if not trace.ok:
        err = trace.errors[-1] if trace.errors else None
        why = f"{err.type}: {err.message}" if err else "the trace is not ok"
        raise Failure(_error_class(trace), f"the verifiers rollout failed ({why})"[:2000])
    usage = Usage()
    for resp in route.responses:
        usage.add(resp.usage)
    fields: dict[str, Any] = {k: v for k, v in trace.metrics.items() if v is not None}
    fields.update({k: r.score for k, r in trace.rewards.items() if r is not None and k not in fields})
    fields["vf_num_turns"] = trace.num_turns
    fields["vf_is_truncated"] = bool(trace.is_truncated)
    response = Response(
        id=f"resp_{uuid.uuid4().hex}",
        created_at=trace.timing.start if hasattr(trace, "timing") and trace.timing else 0.0,
        model=model,
        output=_items(trace, route),
        usage=usage,
        status="incomplete" if trace.is_truncated else "completed",
    )
    return Outcome(response=response, verdict=VerifyReply(reward=float(trace.reward), fields=fields))


def _episode_rows(episode: Any, routes: dict[str, _Route], model: str) -> list[Outcome]:
    if not episode.traces:
        err = episode.errors[-1] if episode.errors else None
        raise Failure("tool_error", f"the verifiers episode failed ({err.type}: {err.message})" if err else "no trace")
    if episode.errors and not episode.ok:  # a hook of the env (run, finalize) failed: the episode is not a result
        err = episode.errors[-1]
        raise Failure("timeout" if episode.is_timeout else "verify_error", f"{err.type}: {err.message}"[:2000])
    return [_outcome(t, routes.get(t.id) or _Route(ctx=None), model) for t in episode.traces]  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- agent


async def _episode(served: Any, task: Any, ctx: AgentContext, model: str, repeat: int) -> Any:
    """One independent episode, as the group's repeat ``repeat``: its calls are its own (a failed group's rows each
    keep their repeat's turns and cost). An episode of K traces judged together is one, its calls no repeat's."""
    with ctx.repeat(repeat):
        return await served.episode(task, ctx, model)


async def _run(ctx: AgentContext, size: int) -> list[Outcome]:
    options = check_options(ctx.config.options)
    served = await _serving(options)
    task = served.task(ctx.row, ctx.task.task_index)
    model = options.model_name or ctx.config.model
    if served.single:  # independent episodes, as verifiers' -r
        done = await asyncio.gather(*(_episode(served, task, ctx, model, i) for i in range(max(size, 1))))
        return [o for ep, routes in done for o in _episode_rows(ep, routes, model)]
    episode, routes = await served.episode(task, ctx, model)  # one episode: its traces judged together
    out = _episode_rows(episode, routes, model)
    if len(out) != max(size, 1):
        raise Failure(
            "invalid_task",
            f"the episode holds {len(out)} traces; run it with group_repeats: true and --repeats {len(out)}",
        )
    return out


async def setup(config: AgentConfig) -> None:
    """Load and serve the environment when the guest starts: one line, and no worker, if it cannot load."""
    try:
        await _serving(check_options(config.options))
    except UserError:  # names its key already
        raise
    except ValueError as e:  # an option's check: names the key below the entry
        raise UserError(f"agents.*.{e}") from None


async def run(ctx: AgentContext) -> Outcome:
    return (await _run(ctx, 1))[0]


async def run_group(ctx: AgentContext, size: int) -> list[Outcome]:
    """K repeats: K independent episodes, or one episode of K traces (an env that judges them together)."""
    return await _run(ctx, size)
