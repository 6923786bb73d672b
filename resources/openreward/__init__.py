"""openreward: an OpenReward (ORS) environment as a gym-runtime resource, its code unchanged.

An ORS environment (``openreward.environments.Environment``) answers every tool call with a ``ToolOutput``:
blocks the model reads, a ``reward`` and ``finished``. Two ways to reach one, one session (one environment
instance for one task, as the SDK's server holds one per session) per rollout:

* **in process** (``options.env: "module:Class"``): the class in the resource worker's guest process
  (``isolation: process``, the default here), driven through the SDK's own session helpers, the code its
  server's routes run (constructor and ``setup()`` when the session is seeded, ``teardown()`` when it closes);
* **a running ORS server** (``options.url``, with ``options.name`` the environment's name there): the SDK's own
  ``Server`` under uvicorn (its process or container), reached through the SDK's own client.

The row offers the environment's tools (``rows.py`` writes rows from its own tasks: ``gym-runtime prepare
config.yaml -i AGENT=env:SPLIT``); each call the model makes is one ORS tool call. The model reads the output's
text blocks; each output's reward is kept per step (``step_rewards``, ``ors_steps``), the episode's reward is
their sum (an output without a reward adds nothing), and ``finished`` ends the episode: the agent stops after
that turn (``Resource.episode_done``), and the SDK refuses any call after it. A call the SDK's server refuses
(a tool it does not know, input its model rejects, a call after ``finished``) is answered with that refusal's
own text, as its client raises it (``ToolCallError.detail``), and the episode goes on. An environment with a
``@terminal`` tool is ended by a plain answer: its text is given to that tool when the response is verified,
as the SDK's harness convention asks (``call_terminal_tool``).

Failures: a constructor or ``setup()`` that raises, a tool that raises (the SDK's client marks the session
dead: ``ToolFailed``), or one that runs past ``tool_timeout_s``: ``tool_error`` rows; a server that cannot be
reached when the worker starts: one line, exit 2; a row without a ``task_spec`` object: ``invalid_task``.
"""

from __future__ import annotations

import importlib
import json
import numbers
import os
from typing import Any, ClassVar

import anyio
import msgspec

from gym_runtime.errors import Failure, UserError
from gym_runtime.messages import FunctionCall, Message, Response, message_text
from gym_runtime.resource import Resource, ToolArgumentsError, Verdict, parse_options
from gym_runtime.resources.openreward.backends import Called, InProcess, Served
from gym_runtime.resources.openreward.rows import function_tools, rows_in_process, rows_served

__all__ = ["OpenRewardResource", "Options", "dataset_rows", "env_tools"]

# The SDK's environment logs a coloured line per tool call on stdout at INFO (its level is read from here once,
# when its loggers are made): thousands of lines for a batch. Its warnings and errors still show, and
# OPENREWARD_LOG_LEVEL=INFO brings the rest back. Set before anything imports the SDK (this module's import
# comes first, in the worker and in its guest, which inherits it).
os.environ.setdefault("OPENREWARD_LOG_LEVEL", "WARNING")


class Options(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    env: str | None = None  # "module:Class": an ORS Environment run in process (the worker's guest)
    url: str | None = None  # a running ORS server (the SDK's Server), e.g. http://127.0.0.1:8080
    name: str | None = None  # the environment's name on that server (default: the first it lists)
    secrets: dict[str, str] = msgspec.field(default_factory=dict)  # passed to the environment as its secrets
    tool_timeout_s: float = 60.0  # a tool call that takes longer is a tool_error row
    connect_timeout_s: float = 10.0  # reaching the server (url) when the worker starts

    def __post_init__(self) -> None:
        if (self.env is None) == (self.url is None):
            raise ValueError("give exactly one of env (an Environment class to run in process) or url (a server)")


def _load_env(path: str) -> Any:
    """``options.env`` loaded: an ORS ``Environment`` subclass; anything else is one line naming the key."""
    module, _, name = path.partition(":")
    try:
        if not name:
            raise ValueError("expected module:Class")
        cls: Any = getattr(importlib.import_module(module), name)
    except Exception as e:  # noqa: BLE001 - the user's module may raise anything on import: one line
        raise UserError(f"openreward options.env: cannot load {path!r}: {type(e).__name__}: {e}") from None
    from openreward.environments import Environment

    is_env = isinstance(cls, type) and issubclass(cls, Environment)
    if not is_env:
        raise UserError(f"openreward options.env: {path!r} is not an openreward.environments.Environment subclass")
    try:
        cls.list_tools()  # what the SDK's Server checks when it starts: tools that describe, one @terminal at most
    except (ValueError, TypeError) as e:
        raise UserError(f"openreward options.env: {path!r}: {e}") from None
    return cls


async def _served_env(opts: Options) -> tuple[Any, Any, str]:
    """The SDK's client for the server at ``opts.url`` and the environment to use there (checked: it lists it)."""
    import aiohttp
    from openreward.api.environments.client import AsyncEnvironmentsAPI

    url = (opts.url or "").rstrip("/")
    try:
        with anyio.fail_after(opts.connect_timeout_s):
            async with aiohttp.ClientSession() as http, http.get(f"{url}/list_environments") as r:
                r.raise_for_status()
                names = await r.json()
    except Exception as e:  # noqa: BLE001 - refused, a timeout, not an ORS server: one line naming the key
        raise UserError(
            f"openreward options.url: {url} does not answer as an ORS server: {type(e).__name__}: {e}"
        ) from None
    name = (opts.name or (names[0] if names else "")).lower()
    if name not in names:
        raise UserError(f"openreward options.name: {opts.name!r} is not served at {url} (it serves {names})")
    api = AsyncEnvironmentsAPI(base_url=url, api_key=None)  # a local server: no key (None: no key header)
    return api, api.get(name), name


def _arguments(name: str, arguments: str | bytes) -> dict[str, Any]:
    """The model's arguments as the SDK's client takes them: a JSON object (its ``bad_input_shape`` otherwise)."""
    try:
        raw = json.loads(arguments or "{}")
    except json.JSONDecodeError as e:
        raise ToolArgumentsError(f"arguments for {name!r} are not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ToolArgumentsError(f"Tool input must be a dictionary, got {type(raw).__name__}")
    return raw


def _reward(value: Any) -> float | None:
    if value is None or (isinstance(value, numbers.Real) and not isinstance(value, bool)):
        return None if value is None else float(value)
    raise Failure("verify_error", f"the environment's tool output has reward {value!r}, not a number")


class OpenRewardTask(msgspec.Struct, kw_only=True):
    task_spec: dict[str, Any]  # the task as the environment's list_tasks gives it (its constructor's task_spec)


class OpenRewardResource(Resource):
    task_fields = OpenRewardTask  # validate and prepare refuse a row without a task spec before any rollout
    reverify = "replay"  # the episode's state comes from its tool calls: reverify runs them again, in order
    row_tools = "any"  # the tools are the environment's own, described and checked by its input models
    requires = ("openreward",)
    install = "pip install 'gym-runtime[openreward]'"
    # the environment's code runs in a guest process the worker can kill: a sync tool (run in a thread by the
    # SDK) that holds the GIL, or one that never returns, cannot silence the worker's bus
    isolation = "process"
    opts: ClassVar[Options]
    env_cls: ClassVar[Any] = None  # the Environment class (in process)
    api: ClassVar[Any] = None  # the SDK's AsyncEnvironmentsAPI (url)
    sdk_env: ClassVar[Any] = None  # its AsyncEnvironment for options.name
    env_name: ClassVar[str] = ""

    @classmethod
    async def setup(cls, options: dict[str, Any]) -> None:
        await super().setup(options)
        cls.opts = parse_options(options, Options, "openreward")
        if cls.opts.env is not None:
            cls.env_cls = _load_env(cls.opts.env)
        else:
            cls.api, cls.sdk_env, cls.env_name = await _served_env(cls.opts)

    @classmethod
    async def teardown(cls) -> None:
        if cls.api is not None:
            await cls.api.aclose()

    async def seed(self, task: dict[str, Any]) -> None:
        await super().seed(task)
        spec = task.get("task_spec")
        if not isinstance(spec, dict):
            raise Failure("invalid_task", "an openreward row needs task_spec: the task's JSON object (its task spec)")
        self.steps: list[dict[str, Any]] = []
        self.finished = False
        if self.env_cls is not None:
            self.backend: InProcess | Served = InProcess(self.env_cls, self.opts.secrets)
        else:
            self.backend = Served(self.sdk_env, self.env_name, self.opts.secrets)
        try:
            with anyio.fail_after(self.opts.tool_timeout_s):
                await self.backend.open(spec)
        except TimeoutError:
            raise Failure(
                "tool_error", f"the environment's setup took longer than tool_timeout_s={self.opts.tool_timeout_s:g}"
            ) from None
        except Exception as e:  # noqa: BLE001 - the environment's constructor or setup() raised
            raise Failure("tool_error", f"the environment's setup raised {type(e).__name__}: {e}") from None

    async def call_tool(self, name: str, arguments: str | bytes) -> str:
        called = await self._call(name, _arguments(name, arguments))
        if called.refused is not None:  # the SDK's refusal, as its client raises it: the model reads why
            raise ToolArgumentsError(called.text)
        return called.text

    async def _call(self, name: str, arguments: dict[str, Any]) -> Called:
        try:
            with anyio.fail_after(self.opts.tool_timeout_s):
                called = await self.backend.call(name, arguments)
        except TimeoutError:
            raise Failure(
                "tool_error", f"tool {name!r} took longer than tool_timeout_s={self.opts.tool_timeout_s:g}"
            ) from None
        except Exception as e:  # noqa: BLE001 - the SDK ends the rollout on a tool that raises (ToolFailed)
            raise Failure("tool_error", f"tool {name!r} raised {type(e).__name__}: {e}") from None
        if called.refused is None:
            reward = _reward(called.reward)
            self.steps.append({"tool": name, "reward": reward, "finished": called.finished})
            if called.finished:
                self.finished = self.episode_done = True
        return called

    async def verify(self, task: dict[str, Any], response: Response) -> Verdict:
        if not self.finished:
            terminal = await self.backend.terminal()
            if terminal is not None:  # a plain answer ends the episode: its text goes to the @terminal tool
                tool, arg = terminal
                answer = next((message_text(m) for m in reversed(response.output) if isinstance(m, Message)), "")
                called = await self._call(tool, {} if arg is None else {arg: answer})
                if called.refused is not None:
                    raise Failure("tool_error", f"the @terminal tool {tool!r} refused the answer: {called.text}")
        rewards = [s["reward"] for s in self.steps]
        return Verdict(
            reward=float(sum(r for r in rewards if r is not None)),
            fields={
                "step_rewards": rewards,
                "ors_steps": list(self.steps),
                "finished": self.finished,
                "tool_calls": sum(isinstance(i, FunctionCall) for i in response.output),
            },
        )

    async def close(self) -> None:
        backend = getattr(self, "backend", None)
        if backend is not None:
            await backend.close()


def env_tools(source: str) -> list[dict[str, Any]]:
    """The Responses function tools of an ORS environment class (``module:Class``), as its ``/tools`` lists
    them (a task's own tools, ``list_task_tools``, are in the rows ``dataset_rows`` writes)."""
    return function_tools(_load_env(source).list_tools().model_dump())


def dataset_rows(options: dict[str, Any], split: str) -> list[dict[str, Any]]:
    """The environment's own tasks of ``split`` as rows (``gym-runtime prepare ... -i AGENT=env:SPLIT``)."""
    opts = parse_options(options, Options, "openreward")
    if opts.env is not None:
        return rows_in_process(_load_env(opts.env), split, opts.secrets)

    async def name() -> str:
        api, _, n = await _served_env(opts)
        await api.aclose()
        return n

    return rows_served((opts.url or "").rstrip("/"), anyio.run(name), split, opts.secrets)


resource = OpenRewardResource
