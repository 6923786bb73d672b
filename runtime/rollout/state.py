"""One rollout's state (``Rollout``): its task and clock, its one ledger, its sessions and sandboxes, its
checkpoints and what a resumed attempt took up, and the port its calls go through. ``agent.AgentContext`` is its
face to the agent's author; the agent worker reads its books from here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

import msgspec

from gym_runtime.errors import Failure
from gym_runtime.messages import (
    Checkpoint,
    CreateParams,
    GenerationProgress,
    HeldSandboxes,
    ModelRequest,
    ModelResponse,
    Response,
    RolloutTask,
)
from gym_runtime.rollout.checkpoint import GENERATING_S, Checkpointer, holding
from gym_runtime.rollout.ledger import Ledger, TrajectoryState
from gym_runtime.rollout.port import Port
from gym_runtime.rollout.session import SessionLink
from gym_runtime.sandboxes.client import Sandboxes
from gym_runtime.sandboxes.kept import keep
from gym_runtime.transport.affinity import Affinity
from gym_runtime.transport.model_calls import PROGRESS_STREAM, cut_at

_progress_decoder = msgspec.msgpack.Decoder(GenerationProgress)


class Settings(Protocol):
    """What the rollout reads of its agent's entry (``config.AgentConfig``): its policy, clock and patience."""

    @property
    def model(self) -> str: ...
    @property
    def timeout_s(self) -> float: ...
    @property
    def absent_grace_s(self) -> float: ...


C = TypeVar("C", bound=Settings)


class Models:
    """What the rollout's model calls need to know of each model, from the worker's config: the call's timeout, the
    model entry's fingerprint and liveness, the models whose generations stop at the rollout's deadline, and the
    worker's rollouts by the replica of their last turn (``transport.affinity``; None: no model routes so)."""

    __slots__ = ("timeout_s", "fingerprint", "liveness_s", "cuttable", "affinity")

    def __init__(
        self,
        timeout_s: Callable[[str], float],
        fingerprint: Callable[[str], str | None] | None = None,
        liveness_s: Callable[[str], float | None] | None = None,
        cuttable: frozenset[str] = frozenset(),
        affinity: Affinity | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.fingerprint = fingerprint or (lambda _name: None)
        self.liveness_s = liveness_s or (lambda _name: None)
        self.cuttable = cuttable
        self.affinity = affinity


class Rollout(Generic[C]):
    """Everything one attempt of one rollout holds (built per task by its worker, or by ``AgentEnvironment``);
    ``config``: its agent's entry."""

    def __init__(self, port: Port, task: RolloutTask, config: C, models: Models, sandboxes: Sandboxes) -> None:
        self.port = port
        self.task = task
        self.config = config
        self.models = models
        self.rollout_key = f"{task.batch}:{task.task_index}:{task.rollout_index}"
        self.ledger = Ledger(task.group)
        # When the runtime cancels this rollout (``timeout_s`` after the context was built, on ``time.monotonic()``'s
        # clock; a resumed attempt's: the rest of it)
        self.deadline = time.monotonic() + config.timeout_s
        self.sandboxes = sandboxes  # one lease (this rollout), ended by the worker when the rollout ends
        sandboxes.rollout = self.rollout_key  # the batch the copies kept for branching go with (``sandboxes.kept``)
        self.sessions: list[SessionLink] = []  # the sessions it opened (a checkpoint's handles)
        self.generating_since: float | None = None  # the policy's model call in flight: its start
        self.continuing: GenerationProgress | None = None  # a checkpoint's generation: the next policy call goes on
        self._progressing = False  # the policy's call in flight sends its tokens so far (``_on_progress``)
        # Resume at the last turn (``rollout.checkpoint``): the rollout's checkpoints (None: not written), the one a
        # redelivered attempt read back, and how it resumed from it (the row's ``resumed_*`` keys)
        self.checkpoints: Checkpointer | None = None
        self.resumed: Checkpoint | None = None
        self.resumed_how: str | None = None
        self.resumed_from_turn = 0
        # ``resumed`` is another rollout's checkpoint (``rollout.branch``): its sessions are restored, never reattached
        self.branching = False
        self.on_restart: Callable[[], None] | None = None  # the worker's: a restarted attempt gets a fresh clock
        # kept for branching: the copies of its own sandboxes made at a turn (``_kept_at``), by turn
        self._kept: tuple[int, asyncio.Future[HeldSandboxes | None]] | None = None
        self.attempt = 1  # the delivery this attempt is (set by the worker)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    async def generate(self, params: CreateParams, name: str) -> Response:
        """One model call, booked in the ledger; the policy's (``config.model``) may be cut at the rollout's deadline
        (its tokens kept) and, once the rollout checkpoints, streams its tokens so far into the checkpoint."""
        policy = name == self.config.model
        cuttable = policy and name in self.models.cuttable  # its generation can be stopped and continued
        progress_s = self._progress_s() if cuttable else None
        started = time.perf_counter()
        request = ModelRequest(
            params=params,
            rollout_key=self.rollout_key,
            fingerprint=self.models.fingerprint(name),
            cut_at=cut_at(self.remaining(), self.config.timeout_s) if cuttable else None,
            progress_s=progress_s,
        )
        if policy:
            self.generating_since = started  # a failure while it runs charges its time to the policy (``attribution``)
            request.continue_from, self.continuing = self.continuing, None
            self._progressing = progress_s is not None
        reply = await self._call(name, request)  # failing, its start stays: the failure row's time split reads it
        if reply.tools_asked and params.tools is not None:  # the very tools asked: held once (``holding``)
            reply.response.tools = params.tools
        self.generating_since, self._progressing = None, False
        self.ledger.model_call(name, reply, started, policy=policy)
        if reply.cut:  # stopped at the rollout's deadline: the rollout ends as its clock would have ended it
            raise Failure("timeout", f"rollout exceeded timeout_s={self.config.timeout_s:g}")
        return reply.response

    async def _call(self, name: str, request: ModelRequest) -> ModelResponse:
        return await self.port.model(
            name,
            request,
            timeout=self.models.timeout_s(name),
            liveness_s=self.models.liveness_s(name),
            wait_s=max(0.0, self.remaining()),  # queued behind other rollouts' calls: as long as the rollout may
            on_output=self._on_progress if request.progress_s is not None else None,
        )

    def _progress_s(self) -> float | None:
        """How often the policy's generation in flight sends its tokens so far, for the checkpoint to keep them
        (None: it is not checkpointed: no checkpoints, no completed turn yet, or a model that cannot stop)."""
        traj = self.ledger.whole.trajectory
        if self.checkpoints is None or traj is None or traj.last is None:
            return None
        return GENERATING_S

    def _on_progress(self, stream: int, data: bytes) -> None:
        """The generation in flight sent its tokens so far: checkpoint them (a resumed attempt continues them)."""
        traj = self.ledger.whole.trajectory
        if stream != PROGRESS_STREAM or traj is None or not self._progressing:
            return  # late: its call answered already (a checkpoint of the turn after it may be written)
        try:
            progress = _progress_decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        self.checkpoint(traj, "answered", generating=progress)

    def checkpoint(self, traj: TrajectoryState, phase: str, generating: GenerationProgress | None = None) -> bool:
        """Write the rollout's checkpoint now when its mode says one is due (``Checkpointer.due``); ``generating``:
        the next turn's generation so far (its turn answered, that generation still running). In the background;
        True when one was asked."""
        box = self.checkpoints
        if box is None or traj.last is None:
            return False
        elapsed = self.config.timeout_s - self.remaining()
        turn = traj.steps - (generating is not None)  # a generation in flight is not a turn made yet
        if not box.due(turn, elapsed):
            return False
        sessions = [h for h in (s.handle() for s in self.sessions) if h is not None]
        cp = holding(traj, self.ledger, turn, phase, elapsed, sessions, self.sandboxes.handles(), generating)
        cp.attempt = self.attempt
        cp.sandbox_lease = self.sandboxes.lease if cp.sandboxes else ""  # the secret a resumed attempt proves
        kept = self._kept_at(turn, cp) if self.task.keep_checkpoints_s and cp.phase == "answered" else None
        box.write(cp, traj.outputs, self.ledger.turns, traj.last, kept)  # a part: what was added since the last write
        return True

    async def copied(self) -> None:
        """Wait for the copies of its own sandboxes still being made (``_kept_at``): its sandboxes are not closed
        under them."""
        if self._kept is not None and not self._kept[1].done():
            await asyncio.wait([self._kept[1]])

    def _kept_at(self, turn: int, cp: Checkpoint) -> asyncio.Future[HeldSandboxes | None] | None:
        """Copies of the agent's own sandboxes as turn ``turn`` ended, for branching (``sandboxes.kept``): made once a
        turn, in the background (the turn's checkpoint waits for them; the next turn's calls wait for that), the
        same for the turn's later writes (its next generation's tokens so far). None: it holds none."""
        if not cp.sandboxes:
            return None
        if self._kept is None or self._kept[0] != turn:
            self._kept = (turn, asyncio.ensure_future(keep(self.sandboxes, self.task.keep_checkpoints_s)))
            self.sandboxes.copying = self._kept[1]  # a sandbox closed meanwhile waits for it
        return self._kept[1]

    def resume_from(self, cp: Checkpoint, how: str) -> None:
        """Take up a checkpoint's ledger (``Ledger.resume_from``) and the generation it was making (continued by
        the next); its sessions add their tool time to this one."""
        self.resumed_how, self.resumed_from_turn = how, cp.turn
        self.continuing = cp.generating
        self.ledger.resume_from(cp)

    def restarted(self) -> None:
        """A checkpoint whose sessions could be neither reattached nor restored: the rollout starts over, with
        a fresh clock."""
        self.resumed_how, self.resumed_from_turn = "restarted", 0
        if self.on_restart is not None:
            self.on_restart()

    def open(self, resource: str, row: dict[str, Any] | None) -> SessionLink:
        """A session on ``resource`` (opened by its first operation), seeded with the task's row, or ``row`` (one
        repeat of a group task, with its own rollout index)."""
        task = self.task
        repeat = self.ledger.repeat()
        link = SessionLink(
            self.port,
            resource,
            task.row if row is None else row,
            absent_grace_s=self.config.absent_grace_s,
            rollout=self.rollout_key,
            check=task.check,
            # a group's repeat (``row``) carries its own indices; the task's row gets the task's
            indices=None
            if row is not None
            else {"_ng_task_index": task.task_index, "_ng_rollout_index": task.rollout_index},
            ledger=self.ledger,
            also=repeat.cost if repeat is not None else None,
            keep_s=task.keep_checkpoints_s,
        )
        self.sessions.append(link)
        return link
