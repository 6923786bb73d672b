"""Model control from the trainer's side: the policy version, pause and resume of a model's replicas.

What the bus carries for it (the KV bucket, the control subjects, every replica's acknowledgement) is
``workers.control``'s; this is the client's half: which models a call means, its arguments checked, each mistake
one ``ClientError``. ``Client.set_policy_version``, ``pause`` and ``resume`` call it.
"""

from __future__ import annotations

from gym_runtime.config import ResolvedConfig
from gym_runtime.errors import ClientError
from gym_runtime.model import PAUSE_MODES, interrupt_problem
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.discovery import discover
from gym_runtime.workers import control

__all__ = ["models_named", "pause", "policy_models", "resume", "set_version"]


def policy_models(config: ResolvedConfig) -> list[str]:
    """The models the config's agents call (the policy), sorted."""
    return sorted({a.model for a in config.agents.values()})


def models_named(config: ResolvedConfig, model: str | None) -> list[str]:
    """The models a call means: ``model``, or the policy's when None."""
    if model is None:
        return policy_models(config)
    if model not in config.models:
        raise ClientError(f"no model named {model!r} in the config ({', '.join(config.models)})")
    return [model]


async def set_version(bus: Bus, config: ResolvedConfig, version: int, model: str | None) -> None:
    """Make ``version`` current for the model(s) (KV + announcement); versions only go up."""
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise ClientError(f"a policy version is a non-negative integer, got {version!r}")
    for m in models_named(config, model):
        current = await control.read_version(bus, m)
        if current is not None and version < current:
            raise ClientError(f"policy version must not go down: {m!r} is at {current}, got {version}")
        await control.publish_version(bus, m, version)


async def pause(bus: Bus, config: ResolvedConfig, model: str | None, mode: str, timeout: float) -> int:
    """Hold new calls of the model(s) until every live replica has none in flight (``Client.pause``); the number
    of replicas that acknowledged."""
    if mode not in PAUSE_MODES:
        raise ClientError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
    models = models_named(config, model)
    if mode == "interrupt":
        for m in models:
            problem = interrupt_problem(config.models[m])
            if problem is not None:
                raise ClientError(f"models.{m}: cannot pause with mode='interrupt': {problem}")
    acked = 0
    for m in models:
        live = {
            str(w["worker"]) for w in await discover(bus, wait_s=0.5) if w.get("role") == "model" and w.get("name") == m
        }
        await control.set_paused(bus, m, True)
        replies = await control.send_pause(bus, m, live, timeout=timeout, mode=mode)
        got = {getattr(r, "worker", None) for r in replies}
        missing = live - got
        if missing:
            raise ClientError(
                f"model {m!r}: replicas {sorted(missing)} did not acknowledge the pause within {timeout:g}s"
            )
        acked += len(got)
    return acked


async def resume(bus: Bus, config: ResolvedConfig, model: str | None) -> None:
    for m in models_named(config, model):
        await control.set_paused(bus, m, False)
        await control.send_resume(bus, m)
