"""Task rows for an ORS environment: its own tasks, prompts and tools, read the way its server serves them.

A row is ``{"responses_create_params": {"input": PROMPT, "tools": TOOLS}, "task_spec": SPEC}``: the prompt is
the environment's ``get_prompt()`` for that task (its text blocks), the tools are what a session of that task
lists (``/task_tools``: the class's tools, the task's own, the ``@terminal`` one left out) as Responses
function tools, converted by the SDK's own ``convert_tool_response(..., format="openai")``.
"""

from __future__ import annotations

from typing import Any

import anyio

from gym_runtime.errors import UserError
from gym_runtime.resources.openreward.backends import block_field

__all__ = ["function_tools", "prompt_text", "rows_in_process", "rows_served"]


def function_tools(listed: dict[str, Any]) -> list[dict[str, Any]]:
    """A ``ListToolsOutput`` (as its server sends it) as Responses function tools."""
    from openreward.api.environments.client import convert_tool_response

    out = []
    for t in convert_tool_response(listed, format="openai"):
        if not t.get("parameters"):  # a tool with no input model: no arguments
            t["parameters"] = {"type": "object", "properties": {}}
        out.append(t)
    return out


def prompt_text(blocks: Any) -> str:
    """The prompt's text blocks joined by newlines; an image prompt is not supported (one line)."""
    parts: list[str] = []
    for b in blocks:
        kind = block_field(b, "type") or "text"
        if kind != "text":
            raise UserError(f"openreward: a prompt block of type {kind!r} is not supported (text prompts only)")
        parts.append(str(block_field(b, "text") or ""))
    return "\n".join(parts)


def _row(spec: Any, prompt: str, tools: list[dict[str, Any]]) -> dict[str, Any]:
    return {"responses_create_params": {"input": prompt, "tools": tools}, "task_spec": spec}


async def _rows_in_process(env_cls: Any, split: str, secrets: dict[str, str]) -> list[dict[str, Any]]:
    from openreward.environments.session import list_session_tools
    from openreward.environments.utils import run_user_callable

    rows = []
    for spec in await env_cls.get_task_range(split):
        env = await run_user_callable(env_cls, task_spec=spec, secrets=dict(secrets))
        try:
            await run_user_callable(env.setup)
            prompt = prompt_text(await run_user_callable(env.get_prompt))
            listed = (await list_session_tools(env, None)).model_dump()
        finally:
            await run_user_callable(env.teardown)
        rows.append(_row(dict(spec), prompt, function_tools(listed)))
    return rows


def rows_in_process(env_cls: Any, split: str, secrets: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """The rows of ``split`` of an environment class (each task set up, prompted and torn down)."""
    if split not in [getattr(s, "name", s) for s in env_cls.list_splits()]:
        raise ValueError(f"{env_cls.__name__} has no split {split!r}")
    return anyio.run(_rows_in_process, env_cls, split, secrets or {})


async def _rows_served(url: str, name: str, split: str, secrets: dict[str, str]) -> list[dict[str, Any]]:
    from openreward.api.environments.client import AsyncEnvironmentsAPI

    api = AsyncEnvironmentsAPI(base_url=url, api_key=None)  # a local server: no key (None: no key header)
    try:
        env = api.get(name)
        rows = []
        for task in await env.list_tasks(split):
            async with env.session(task=task, secrets=dict(secrets) or None) as session:
                prompt = prompt_text(await session.get_prompt())
                tools = await session.list_tools(format="openai")
            rows.append(_row(dict(task.task_spec), prompt, [_with_parameters(t) for t in tools]))
        return rows
    finally:
        await api.aclose()


def _with_parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool if tool.get("parameters") else {**tool, "parameters": {"type": "object", "properties": {}}}


def rows_served(url: str, name: str, split: str, secrets: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """The rows of ``split`` of the environment ``name`` on a running ORS server, through the SDK's client."""
    return anyio.run(_rows_served, url, name, split, secrets or {})
