"""Two ways to reach an ORS environment, one session (one environment instance, one task) each.

* ``InProcess``: the environment class in this process (under ``isolation: process``, the worker's guest),
  driven through the SDK's own session helpers (``openreward.environments.session``): the code its server's
  ``/create``, ``/call`` and ``/delete`` routes run, without HTTP.
* ``Served``: a running ORS server (the SDK's ``Server``, under uvicorn, anywhere) through the SDK's own
  client (``AsyncEnvironmentsAPI``): one SDK session per ours.

Both answer a tool call with a ``Called``: the tool's output, or the refusal the SDK's server gives (a tool
it does not know, input that fails the tool's model, a call after the episode finished). A tool that
raises is raised on (the caller makes it a ``tool_error`` row).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Called", "InProcess", "Served", "block_field", "output_text"]


@dataclass(frozen=True, slots=True)
class Called:
    """One tool call's outcome. ``refused``: the SDK's reason (``not_found``, ``input_validation``,
    ``episode_finished``, ``bad_input_shape``, ...) with ``text`` its error message; else ``text`` is what
    the model reads of the output's blocks and ``reward``/``finished`` are the output's own."""

    text: str
    reward: float | None = None
    finished: bool = False
    refused: str | None = None


def block_field(block: Any, key: str) -> Any:
    """A field of a content block, whether the SDK's client decoded it (a dataclass) or its server's model
    (pydantic) or the wire's dict holds it."""
    return block.get(key) if isinstance(block, dict) else getattr(block, key, None)


def output_text(blocks: Any) -> str:
    """What the model reads of a tool output's blocks: the text blocks joined by newlines (the SDK's own
    text rendering of a tool result); an image block is named, not shown (a text tool output cannot carry it)."""
    parts: list[str] = []
    for b in blocks:
        if block_field(b, "type") == "image":
            parts.append(f"[image: {block_field(b, 'mimeType') or ''}]")
        else:
            parts.append(str(block_field(b, "text") or ""))
    return "\n".join(parts)


class InProcess:
    """One environment instance of ``env_cls`` for one task, as the SDK's server holds one per session."""

    def __init__(self, env_cls: type, secrets: dict[str, str]) -> None:
        self.env_cls, self.secrets = env_cls, secrets
        self.env: Any = None

    async def open(self, task_spec: dict[str, Any]) -> None:
        from openreward.environments.utils import run_user_callable

        # what the server's /create does: the constructor off the event loop, then setup() before any call
        self.env = await run_user_callable(self.env_cls, task_spec=task_spec, secrets=dict(self.secrets))
        await run_user_callable(self.env.setup)

    async def call(self, name: str, arguments: dict[str, Any]) -> Called:
        from openreward.environments import RunToolError
        from openreward.environments.session import call_session_tool

        res = (await call_session_tool(self.env, None, name, arguments)).root
        if isinstance(res, RunToolError):
            return Called(text=res.error, refused=res.reason or "input_validation")
        out = res.output
        return Called(text=output_text(out.blocks), reward=out.reward, finished=out.finished)

    async def terminal(self) -> tuple[str, str | None] | None:
        """The environment's ``@terminal`` tool (name, argument), or None."""
        term = self.env.list_tools().terminal_tool
        return None if term is None else (term.name, term.arg)

    async def close(self) -> None:
        if self.env is not None:
            from openreward.environments.utils import run_user_callable

            env, self.env = self.env, None
            await run_user_callable(env.teardown)


class Served:
    """One SDK session on a running ORS server: the SDK's client creates it (``/create_session``,
    ``/create``), calls tools (``/call``, an SSE stream), pings it and deletes it."""

    def __init__(self, env: Any, name: str, secrets: dict[str, str]) -> None:
        self.sdk_env, self.name, self.secrets = env, name, secrets
        self.session: Any = None

    async def open(self, task_spec: dict[str, Any]) -> None:
        from openreward.api.environments.types import Task

        task = Task(server_name=self.name, environment_name=self.name, task_spec=task_spec, namespace=None)
        session = self.sdk_env.session(task=task, secrets=dict(self.secrets) or None)
        await session.__aenter__()
        self.session = session

    async def call(self, name: str, arguments: dict[str, Any]) -> Called:
        from openreward.api.errors import ToolCallError

        try:
            out = await self.session.call_tool(name, arguments)
        except ToolCallError as e:
            return Called(text=e.detail, refused=e.reason)
        return Called(text=output_text(out.blocks), reward=out.reward, finished=out.finished)

    async def terminal(self) -> tuple[str, str | None] | None:
        term = await self.session.terminal_tool()
        return None if term is None else (term.name, term.arg)

    async def close(self) -> None:
        if self.session is not None:
            session, self.session = self.session, None
            await session.__aexit__(None, None, None)
