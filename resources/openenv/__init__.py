"""openenv: an OpenEnv environment (``reset`` / ``step`` / ``state``) as a gym-runtime resource.

Two ways to reach it, one session (one environment instance, one episode) per rollout:

* **in process** (``options.env: "module:EnvClass"``): the class, written against OpenEnv's
  ``Environment`` API, is instantiated in the resource worker for each session; sync ``step``/
  ``reset`` run in a worker thread (as OpenEnv's own server runs them), ``step_async`` when
  the class overrides it.
* **a running OpenEnv server** (``options.url: http://host:port``, its container or process):
  each session is a WebSocket session of OpenEnv's own client (``GenericEnvClient``); ``/health``
  is checked and ``/schema`` read over HTTP when the worker starts. A server at its
  ``max_concurrent_envs`` (1 in OpenEnv's template) refuses a session with ``CAPACITY_REACHED``:
  the session asks again with jittered backoff up to ``options.capacity_wait_s`` (no HTTP route
  tells the capacity), so the rows queue at the server's width instead of failing.

The agent drives it in one of two ways, as the environment suits:

* **tool calls** (``agents.simple``): the model acts through one tool (``options.tool``, default
  ``step``) whose arguments are the environment's action (its fields as JSON; the row offers
  the tool with the action's schema, ``action_tool()`` writes it). Each call is one ``step``;
  the model reads the observation, reward and ``done`` as JSON.
* **policy turns** (``agents.multi_turn`` with ``user: env``): this is a ``GymResource``; each
  policy turn is one ``step`` whose action is the turn's text (a JSON object of the action's
  fields, or the text itself for an action with one required string field, read from the action's
  schema: its class in process, the server's ``/schema``); the observation (JSON) is the next user
  turn, ``done`` ends the episode. An episode in which no turn was an action is a ``verify_error``
  row naming the action's fields, not a silent reward of 0.

**MCP tools** (an ``MCPEnvironment``, or a server of one): each tool it lists (OpenEnv's
``ListToolsAction``) is a function tool the model may call (``mcp_tools()`` writes them for the
row, as ``action_tool()`` writes the action tool); a call is one ``CallToolAction`` through the
environment's own ``step`` (so its MCP server runs the tool and its step sets reward and
``done``), and the model reads what OpenEnv's ``MCPToolClient.call_tool`` returns: the tool's
data, or that client's ``Tool '...' failed: ...`` text for a tool that raised.

After ``done`` further steps are refused (the model reads why). ``reset`` runs when the
session is seeded, with the row's ``openenv_reset`` mapping as its keyword arguments. The
reward is the sum of the step rewards (``step_rewards`` and ``done`` are row fields).

``options.action`` names the Action class where ``step`` does not annotate it (without it, the
worker stops with one line naming the key, exit 2).

Failures: ``reset`` that raises is a ``tool_error`` row (as any seed); ``step`` that raises,
or takes longer than ``options.step_timeout_s``, is a ``tool_error`` row (OpenEnv's runner
stops on both); a reward that is not a number is a ``verify_error`` row.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import numbers
import random
import time
import typing
from typing import Any, ClassVar

import anyio
import msgspec

from gym_runtime.errors import Failure, UserError
from gym_runtime.gymnasium import Action as PolicyTurn
from gym_runtime.gymnasium import GymResource, Step
from gym_runtime.messages import Response
from gym_runtime.resource import ToolArgumentsError, Verdict, decode_arguments, parse_options, run_blocking

__all__ = ["OpenEnvResource", "Options", "action_tool", "mcp_tools"]

_CAPACITY_BACKOFF_S = (0.05, 1.0)  # first and longest wait between asks of a server at capacity


class Options(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    env: str | None = None  # "module:Class": an OpenEnv Environment run in process
    action: str | None = None  # "module:Class": its Action (default: the type of step's ``action``)
    url: str | None = None  # a running OpenEnv server (http:// or ws://)
    tool: str = "step"  # the tool name the model calls to act
    step_timeout_s: float = 60.0
    connect_timeout_s: float = 10.0
    capacity_wait_s: float = 120.0  # how long a session waits for a server at max_concurrent_envs to take it

    def __post_init__(self) -> None:
        if (self.env is None) == (self.url is None):
            raise ValueError("give exactly one of env (an Environment class to run in process) or url (a server)")


def _load(path: str) -> Any:
    module, _, name = path.partition(":")
    if not name:
        raise ValueError(f"{path!r}: expected module:Class")
    return getattr(importlib.import_module(module), name)


def _load_option(key: str, path: str) -> Any:
    """``options.KEY`` (``module:Class``) loaded; one that cannot be is a config error naming the key."""
    try:
        return _load(path)
    except Exception as e:  # noqa: BLE001 - the user's module may raise anything on import: one line
        raise UserError(f"openenv options.{key}: cannot load {path!r}: {type(e).__name__}: {e}") from None


def _action_class(env_cls: Any) -> Any:
    """The action type ``step`` annotates; without one, a config error naming ``options.action``."""
    try:
        action = typing.get_type_hints(env_cls.step).get("action")
    except Exception:  # noqa: BLE001 - an annotation that does not resolve (a name only under TYPE_CHECKING)
        action = None
    if not isinstance(action, type):
        raise UserError(
            f"openenv options.action: {env_cls.__name__}.step has no annotated action type;"
            " name its Action class there (action: 'module:ActionClass')"
        )
    return action


def _text_field(schema: dict[str, Any] | None) -> str | None:
    """The action's one required string field (a plain-text policy turn is its value), from its JSON schema."""
    if not schema:
        return None
    required = [n for n in schema.get("required") or [] if n != "metadata"]
    if len(required) != 1:
        return None
    return required[0] if (schema.get("properties") or {}).get(required[0], {}).get("type") == "string" else None


def _fields_text(schema: dict[str, Any] | None) -> str:
    """The action's fields as the policy and the user read them: ``delta (integer), note (string, optional)``."""
    if not schema:
        return "(unknown: the server has no /schema)"
    required = set(schema.get("required") or [])
    out = []
    for name, prop in (schema.get("properties") or {}).items():
        if name == "metadata":
            continue
        kind = prop.get("type") or "/".join(str(p.get("type", "object")) for p in prop.get("anyOf") or []) or "object"
        out.append(f"{name} ({kind}{'' if name in required else ', optional'})")
    return ", ".join(out) or "(none)"


def _at_capacity(e: Exception) -> bool:
    """OpenEnv's server refused the session: it holds max_concurrent_envs sessions already (its client
    raises RuntimeError with the error frame's code)."""
    return isinstance(e, RuntimeError) and "CAPACITY_REACHED" in str(e)


def action_tool(action_cls: Any, *, name: str = "step", description: str = "") -> dict[str, Any]:
    """The Responses function tool a row offers for an OpenEnv action class."""
    schema = action_cls.model_json_schema()
    schema.pop("title", None)
    props = schema.get("properties", {})
    props.pop("metadata", None)  # OpenEnv's own bookkeeping, not the model's to set
    return {
        "type": "function",
        "name": name,
        "description": description or (action_cls.__doc__ or "").strip(),
        "parameters": schema,
    }


def _function_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """OpenEnv's MCP ``Tool``s (objects or their JSON) as Responses function tools."""
    out = []
    for t in tools:
        t = t.model_dump() if hasattr(t, "model_dump") else dict(t)
        out.append(
            {
                "type": "function",
                "name": t["name"],
                "description": t.get("description") or "",
                "parameters": t.get("input_schema") or t.get("inputSchema") or {"type": "object"},
            }
        )
    return out


def mcp_tools(source: str) -> list[dict[str, Any]]:
    """The function tools a row offers for an OpenEnv environment's MCP tools, as the environment lists
    them (``ListToolsAction``): ``source`` is its class (``module:Class``) or a server's URL."""
    from openenv.core.env_server.mcp_types import ListToolsAction

    if "://" not in source:
        env = _load(source)()
        try:
            return _function_tools(env.step(ListToolsAction()).tools)
        finally:
            env.close()

    async def listed() -> list[Any]:
        from openenv.core.generic_client import GenericEnvClient

        client = GenericEnvClient(base_url=source)
        await client.connect()
        try:
            return list((await client.step({"type": "list_tools"})).observation.get("tools") or [])
        finally:
            await client.close()

    return _function_tools(anyio.run(listed))


def _tool_output(name: str, obs: dict[str, Any]) -> str:
    """What OpenEnv's MCPToolClient.call_tool gives for this observation: the tool's data, or its error."""
    error = obs.get("error")
    if error:
        kind = error.get("error_type")
        kind = getattr(kind, "value", kind)
        return f"Tool '{name}' failed: {error.get('message')} (type: {kind})"
    result = obs.get("result")
    if isinstance(result, dict) and "data" in result:
        result = result["data"]
    return result if isinstance(result, str) else json.dumps(result)


def _is_mcp(env_cls: type) -> bool:
    """An MCPEnvironment, told without importing OpenEnv's MCP module (it imports fastmcp: seconds, which
    a worker must not spend in its event loop for an environment that has no MCP tools)."""
    return any(c.__name__ == "MCPEnvironment" and c.__module__.startswith("openenv.") for c in env_cls.__mro__)


def _reward(value: Any) -> float:
    if value is None:
        return 0.0
    if isinstance(value, numbers.Real):
        return float(value)
    raise Failure("verify_error", f"the environment's step returned reward {value!r}, not a number")


class OpenEnvResource(GymResource):
    row_tools = "any"  # the action tool's schema is the environment's, checked by its Action model
    requires = ("openenv",)
    install = "pip install 'gym-runtime[openenv]'"
    # an in-process step is the environment's own code, sync, in a thread step_timeout_s cannot stop: it runs
    # in a guest process the worker can kill, so a step that holds the GIL cannot silence the worker
    isolation = "process"
    opts: ClassVar[Options]
    env_cls: ClassVar[Any] = None  # the OpenEnv Environment class (in process)
    action_cls: ClassVar[Any] = None  # its Action (a pydantic model)
    mcp_names: ClassVar[frozenset[str] | None] = None  # its MCP tools, listed at the first seed
    mcp_server: ClassVar[bool] = False  # the server (url) takes MCP actions (its /schema says so)
    action_schema: ClassVar[dict[str, Any] | None] = None  # the action's JSON schema (its class's, or /schema's)
    client_cls: ClassVar[Any] = None  # OpenEnv's GenericEnvClient (url), imported at setup

    @classmethod
    async def setup(cls, options: dict[str, Any]) -> None:
        await super().setup(options)
        cls.opts = parse_options(options, Options, "openenv")
        if cls.opts.env is not None:
            cls.env_cls = _load_option("env", cls.opts.env)
            cls.action_cls = _load_option("action", cls.opts.action) if cls.opts.action else _action_class(cls.env_cls)
            cls.action_schema = cls.action_cls.model_json_schema()
        else:
            import httpx

            # imported here, before the worker serves: at the first seed it held the event loop 2.6 s at load 4
            # (over the bus's 10 s liveness at load 15: the waiting seeds were worker_lost rows)
            from openenv.core.generic_client import GenericEnvClient

            cls.client_cls = GenericEnvClient
            base = cls.opts.url.replace("ws://", "http://").replace("wss://", "https://").rstrip("/")  # type: ignore[union-attr]
            async with httpx.AsyncClient(timeout=cls.opts.connect_timeout_s) as http:
                health = await http.get(f"{base}/health")
                health.raise_for_status()
                schema = await http.get(f"{base}/schema")  # an MCP server's action is CallToolAction
                action = schema.json().get("action") if schema.status_code == 200 else None
                cls.action_schema = action if isinstance(action, dict) else None
                cls.mcp_server = "tool_name" in ((action or {}).get("properties") or {})

    async def seed(self, task: dict[str, Any]) -> None:
        await super().seed(task)
        self.rewards: list[float] = []
        self.done = False
        self.not_actions = 0  # policy turns that were no action (plain text for an action of several fields)
        reset_args = task.get("openenv_reset") or {}
        if self.env_cls is not None:
            self.env = self.env_cls()
            out = await self._call(self.env.reset, **reset_args)
        else:
            out = await self._open(reset_args)
        self.first_observation = self._observation(out)
        if type(self).mcp_names is None:
            type(self).mcp_names = frozenset(await self._list_mcp())

    async def _open(self, reset_args: dict[str, Any]) -> Any:
        """A server session, reset. A server at ``max_concurrent_envs`` (1 in OpenEnv's template) refuses it
        with CAPACITY_REACHED and does not say when a session frees up (no HTTP route tells its capacity):
        ask again with backoff, up to ``capacity_wait_s``, instead of failing the rollout."""
        give_up = time.monotonic() + self.opts.capacity_wait_s
        delay = _CAPACITY_BACKOFF_S[0]
        while True:
            client = self.client_cls(base_url=self.opts.url, connect_timeout_s=self.opts.connect_timeout_s)
            try:
                await client.connect()
                out = await client.reset(**reset_args)
            except Exception as e:
                with contextlib.suppress(Exception):  # the refused socket is closed already
                    await client.close()
                if not _at_capacity(e):
                    raise
                if time.monotonic() + delay > give_up:
                    raise Failure(
                        "tool_error",
                        f"the OpenEnv server stayed at its capacity (max_concurrent_envs) for"
                        f" capacity_wait_s={self.opts.capacity_wait_s:g}: {e}",
                    ) from None
                await anyio.sleep(delay * random.uniform(0.5, 1.0))  # jittered: waiting sessions do not ask in step
                delay = min(delay * 2, _CAPACITY_BACKOFF_S[1])
                continue
            self.client = client
            return out

    async def _list_mcp(self) -> list[str]:
        """The names of the MCP tools the environment lists (none when it is not an MCP environment)."""
        if self.env_cls is not None:
            if not _is_mcp(self.env_cls):
                return []
            from openenv.core.env_server.mcp_types import ListToolsAction

            obs = await self.env.step_async(ListToolsAction())
            return [t.name for t in obs.tools]
        if not self.mcp_server:
            return []
        result = await self.client.step({"type": "list_tools"})
        return [t["name"] for t in self._observation(result).get("tools") or []]

    async def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """A sync OpenEnv method in a worker thread (the loop keeps serving other sessions)."""
        return await run_blocking(lambda: fn(*args, **kwargs), abandon=True)

    @staticmethod
    def _observation(out: Any) -> dict[str, Any]:
        obs = getattr(out, "observation", out)  # a client StepResult wraps it; an in-process step returns it
        if hasattr(obs, "model_dump"):  # reward and done travel beside it, as OpenEnv's server sends them
            return dict(obs.model_dump(exclude={"reward", "done"}))
        return dict(obs) if isinstance(obs, dict) else {"value": obs}

    async def reset(self, task: dict[str, Any]) -> None:
        return None  # the episode was reset when the session was seeded; the prompt is the task's input

    async def step(self, action: PolicyTurn) -> Step:
        """One policy turn as one OpenEnv step (agents.multi_turn with user: env)."""
        text = action.text.strip()
        try:
            raw = json.loads(text)
        except json.JSONDecodeError:
            raw = None
        if not isinstance(raw, dict):
            field = _text_field(self.action_schema)
            if field is None:
                self.not_actions += 1
                return Step(observation=f"Error: answer with a JSON object of the action's fields: {self._fields()}")
            raw = {field: action.text}
        try:
            reward, done, obs = await self._act(raw)
        except ToolArgumentsError as e:  # the policy reads why, as it would from a tool
            return Step(observation=f"Error: {e}")
        return Step(observation=json.dumps(obs), reward=reward, terminated=done)

    def _fields(self) -> str:
        return _fields_text(self.action_schema)

    async def call_tool(self, name: str, arguments: str | bytes) -> str:
        mcp = name != self.opts.tool and name in (self.mcp_names or ())  # OpenEnv reserves "step" for itself
        if name != self.opts.tool and not mcp:
            known = ", ".join(sorted({self.opts.tool, *(self.mcp_names or ())}))
            raise ToolArgumentsError(f"unknown tool {name!r}; available tools: {known}")
        reward, done, obs = await self._act(decode_arguments(name, arguments), mcp=name if mcp else None)
        if mcp:
            return _tool_output(name, obs)
        return json.dumps({"observation": obs, "reward": reward, "done": done})

    async def _act(self, raw: dict[str, Any], *, mcp: str | None = None) -> tuple[float, bool, dict[str, Any]]:
        """One OpenEnv step (an MCP tool's ``CallToolAction`` when ``mcp`` names it): reward, done, observation."""
        if self.done:
            raise ToolArgumentsError("the episode is over (done); no more steps")
        try:
            with anyio.fail_after(self.opts.step_timeout_s):
                reward, done, obs = await (self._step(raw) if mcp is None else self._call_mcp(mcp, raw))
        except TimeoutError:
            raise Failure(
                "tool_error", f"the environment's step took longer than step_timeout_s={self.opts.step_timeout_s:g}"
            ) from None
        except (Failure, ToolArgumentsError):
            raise
        except Exception as e:  # noqa: BLE001 - OpenEnv's runner stops on a step that raises: a failure row
            raise Failure("tool_error", f"the environment's step raised {type(e).__name__}: {e}") from None
        self.rewards.append(reward)
        self.done = done
        return reward, done, obs

    async def _step(self, raw: dict[str, Any]) -> tuple[float, bool, dict[str, Any]]:
        if self.env_cls is not None:
            import pydantic

            assert self.action_cls is not None
            try:
                action = self.action_cls.model_validate(raw)
            except pydantic.ValidationError as e:
                raise ToolArgumentsError(f"arguments do not match the action: {e}") from None
            overridden = type(self.env).step_async is not _base_step_async()
            out = await (self.env.step_async(action) if overridden else self._call(self.env.step, action))
            obs = self._observation(out)
            return _reward(getattr(out, "reward", None)), bool(getattr(out, "done", False)), obs
        result = await self.client.step(raw)
        return _reward(result.reward), bool(result.done), self._observation(result)

    async def _call_mcp(self, name: str, arguments: dict[str, Any]) -> tuple[float, bool, dict[str, Any]]:
        if self.env_cls is not None:
            from openenv.core.env_server.mcp_types import CallToolAction

            out = await self.env.step_async(CallToolAction(tool_name=name, arguments=arguments))
            obs = self._observation(out)
            return _reward(getattr(out, "reward", None)), bool(getattr(out, "done", False)), obs
        result = await self.client.step({"type": "call_tool", "tool_name": name, "arguments": arguments})
        return _reward(result.reward), bool(result.done), self._observation(result)

    async def verify(self, task: dict[str, Any], response: Response) -> Verdict:
        if self.not_actions and not self.rewards:  # a reward of 0 here would hide that nothing was played
            raise Failure(
                "verify_error",
                f"no policy turn was an action: {self.not_actions} turn(s) were not a JSON object of the action's"
                f" fields: {self._fields()} (say so in the prompt, e.g. 'answer with a JSON object')",
            )
        return Verdict(
            reward=float(sum(self.rewards)),
            fields={
                "step_rewards": list(self.rewards),
                "done": self.done,
                **(self.episode_fields() if self.steps else {}),  # driven by policy turns: NeMo Gym's gymnasium fields
            },
        )

    async def close(self) -> None:
        env = getattr(self, "env", None)
        if env is not None:
            await self._call(env.close)
        client = getattr(self, "client", None)
        if client is not None:
            await client.close()


def _base_step_async() -> Any:
    from openenv.core.env_server.interfaces import Environment

    return Environment.step_async


resource = OpenEnvResource
