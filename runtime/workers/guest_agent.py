"""An agent's rollouts in a guest process (``agents.NAME.isolation: process``): its code there, the bus here.

A verifiers environment runs its whole rollout loop (``env_response``, tools, stop conditions) and its rubric in
the agent's own code. Code that holds the GIL there (a rubric's quadratic regex on a long model answer) stopped
the agent worker's bus: its keepalives stopped and every rollout in flight on it was lost. Here each rollout is
one call to a guest process (``workers.guest``, the machinery hosted servers run in); its model calls come back
over the guest wire and the worker makes them with the rollout's own ``AgentContext`` (routing, token ids,
policy versions, the rollout's trace), so what the agent sees of the model is unchanged.

When a rollout's own code runs ``call_timeout_s`` past its last model call, the guest is killed and another
starts: that rollout fails as ``timeout``; the others that were in the killed guest fail as a retryable
``worker_lost``, which the agent worker hands back to the queue as a lost worker (a new attempt, not a failed
one). A rollout the worker gives up on (``timeout_s``) is cancelled in the guest; if the guest does not answer
that within ``CANCEL_GRACE_S`` it is stuck, and is killed the same way.
"""

from __future__ import annotations

import asyncio
import sys
import uuid

import anyio
import anyio.abc
import msgspec

from gym_runtime.agent import AgentContext, Outcome
from gym_runtime.config import AgentConfig
from gym_runtime.errors import Failure, UserError
from gym_runtime.messages import CreateParams, Response
from gym_runtime.workers.guest import Guest, GuestFailure
from gym_runtime.workers.guest_frames import Close, Rollout, Start

__all__ = ["CANCEL_GRACE_S", "GuestAgent", "is_lost"]

CANCEL_GRACE_S = 2.0  # a cancelled rollout's guest answers within this, or it is stuck holding the GIL


class _NoRollout:
    """The guest's model client for a model call of no known rollout (one the worker gave up on): refused."""

    async def generate(self, params: CreateParams, *, model: str) -> Response:
        raise Failure("cancelled", "this rollout's worker no longer waits for it")


class GuestAgent:
    """The worker side: ``run(ctx)`` and ``run_group(ctx, size)`` of an agent module, each rollout a guest call."""

    def __init__(
        self,
        name: str,
        cfg: AgentConfig,
        *,
        groups: bool,
        python: str = sys.executable,
        env: dict[str, str] | None = None,
    ) -> None:
        """``python``/``env``: the interpreter the guest runs on and what it adds to its environment (an agent whose
        package lives in a built environment of its own, as verifiers 0.4's: ``hosting.env.ensure_verifiers``)."""
        if cfg.resource or cfg.sandbox:  # their clients live on the bus, which the guest has not
            raise UserError(
                f"agents.{name}: isolation: process runs agents that open no resource sessions or sandboxes;"
                " set isolation: none"
            )
        start = Start(server=cfg.agent, entry=name, options=msgspec.to_builtins(cfg), agent=True)
        self.guest = Guest(start, _NoRollout(), cfg.call_timeout_s, python=python, env=env, where=f"agents.{name}")
        self.run_group = self._run_group if groups else None

    async def run_guest(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Keep a guest running until cancelled (``started`` once the first has run the module's ``setup``)."""
        await self.guest.run(task_status=task_status)

    async def run(self, ctx: AgentContext) -> Outcome:
        (outcome,) = await self._rollout(ctx, 0)
        return outcome

    async def _run_group(self, ctx: AgentContext, size: int) -> list[Outcome]:
        return await self._rollout(ctx, size)

    async def _rollout(self, ctx: AgentContext, size: int) -> list[Outcome]:
        session = uuid.uuid4().hex
        try:
            done, _ = await self.guest.call(
                lambda i: Rollout(id=i, session=session, task=ctx.task, remaining_s=ctx.remaining(), size=size),
                None,
                models=ctx,
            )
        except asyncio.CancelledError:
            with anyio.CancelScope(shield=True):
                await self._cancel(session)
            raise
        assert done.outcomes is not None
        return done.outcomes

    async def _cancel(self, session: str) -> None:
        """The worker stopped waiting (the rollout's ``timeout_s``): the guest cancels that rollout, or, stuck, is
        killed (a guest that answered the call itself, or is gone already, has nothing left to cancel)."""
        guest = self.guest
        generation = guest.generation
        if generation is None:
            return
        with anyio.move_on_after(CANCEL_GRACE_S):
            try:
                await guest.call(lambda i: Close(id=i, session=session), generation)
            except GuestFailure:
                pass  # that guest is gone
            return
        guest.stop(generation, f"a cancelled rollout did not stop within {CANCEL_GRACE_S:g} s")


def is_lost(e: BaseException) -> bool:
    """A rollout that lived in a guest killed for another's fault: a lost worker, not an attempt that failed."""
    return isinstance(e, GuestFailure) and e.info.error_class == "worker_lost"
