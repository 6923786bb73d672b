"""gym-runtime: an actor-style async runtime over NATS for LLM RL environments and verified rollouts.

The public API, by who uses it::

    # an environment author
    from gym_runtime import Resource, tool, Verdict, run_in_process

    # an agent author
    from gym_runtime import AgentContext, Outcome, Failure

    # a model adapter author (a module with Options and create(); see gym_runtime.model)
    from gym_runtime import AdapterOptions, ModelAdapter, ModelError

    # a trainer (rollouts from Python, warm workers, policy versions)
    from gym_runtime import Client, SyncClient

Everything listed in ``__all__`` is stable; modules whose names start with an
underscore, and names not listed here, are internal. Names are imported on first
use (PEP 562), so ``import gym_runtime.messages`` does not pull in NATS,
OpenTelemetry or the HTTP stack.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gym_runtime.agent import AgentContext, Outcome, Session
    from gym_runtime.client import BatchHandle, Client
    from gym_runtime.client.sync import SyncBatch, SyncClient
    from gym_runtime.config import Config, load_config, resolve_config
    from gym_runtime.errors import (
        ClientError,
        ConfigError,
        Failure,
        GymError,
        InputError,
        ModelError,
        PublishTimeout,
        RolloutFailed,
        UserError,
    )
    from gym_runtime.gymnasium import Action, GymResource, Reset, Step
    from gym_runtime.messages import (
        CreateParams,
        ErrorInfo,
        FunctionCall,
        FunctionCallOutput,
        Message,
        Reasoning,
        Response,
        Usage,
        VerifyReply,
        assistant_message,
        create_params,
        last_item_text,
        output_text,
    )
    from gym_runtime.model import AdapterOptions, ModelAdapter
    from gym_runtime.resource import ModelClient, Resource, Verdict, run_blocking, run_in_process, tool

__version__: str  # the installed distribution's, looked up on first access (``__getattr__``)

# Where each public name lives (imported on first access).
_HOME: dict[str, str] = {
    # environment authors
    "Resource": "resource",
    "tool": "resource",
    "Verdict": "resource",
    "run_in_process": "resource",
    "run_blocking": "resource",
    "ModelClient": "resource",
    "GymResource": "gymnasium",
    "Action": "gymnasium",
    "Reset": "gymnasium",
    "Step": "gymnasium",
    # agent authors
    "AgentContext": "agent",
    "Session": "agent",
    "Outcome": "agent",
    # model adapter authors
    "ModelAdapter": "model",
    "AdapterOptions": "model",
    # messages users touch
    "CreateParams": "messages",
    "Response": "messages",
    "Message": "messages",
    "FunctionCall": "messages",
    "FunctionCallOutput": "messages",
    "Reasoning": "messages",
    "Usage": "messages",
    "VerifyReply": "messages",
    "ErrorInfo": "messages",
    "assistant_message": "messages",
    "create_params": "messages",
    "output_text": "messages",
    "last_item_text": "messages",
    # trainers
    "Client": "client",
    "SyncClient": "client.sync",
    "BatchHandle": "client",
    "SyncBatch": "client.sync",
    # configuration
    "Config": "config",
    "load_config": "config",
    "resolve_config": "config",
    # the error tree
    "GymError": "errors",
    "Failure": "errors",
    "UserError": "errors",
    "ConfigError": "errors",
    "InputError": "errors",
    "ModelError": "errors",
    "ClientError": "errors",
    "PublishTimeout": "errors",
    "RolloutFailed": "errors",
}

__all__ = [*_HOME, "__version__"]


def _version() -> str:
    """The installed distribution's version, looked up on first use: ``importlib.metadata`` and its
    scan of the installed distributions cost every command ~30 ms of start-up, and only ``--version``
    and callers of ``gym_runtime.__version__`` read it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gym-runtime")
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "0.0.0"


def __getattr__(name: str) -> Any:
    if name == "__version__":
        value: Any = _version()
        globals()[name] = value
        return value
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'gym_runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"gym_runtime.{home}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
