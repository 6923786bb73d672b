"""Which stored results a reader of a batch takes: its owner's, for a slot the batch has, by one rule for attempts.

Every agent pool may store results only under its own subject ``{ns}.result.{agent}.{batch}``, but under any
batch id and claiming any slot. So every reader of the results stream (``collect``, the client's batches and
runs, ``status``) takes a result only when its subject's agent is the agent that owns the task (the batch
manifest's ranges), the result says the same agent and batch as its subject, and its task and rollout index
exist in the batch. Anything else is counted and logged once per interval, and never written: it does not
take the slot, so it cannot make the genuine result a duplicate.

A result is also stored the way an agent stores one, or not taken: with a ``Nats-Msg-Id`` naming its slot
(``result_msg_id``), and without the headers JetStream puts on a direct get's answer (``Nats-Stream``,
``Nats-Sequence``, ``Nats-Subject``): a stored message that carries them is a server's answer that a requester
sent into a result subject (a borrowed reply; the secured server's accounts keep such answers out of the
streams, this is the check that does not depend on it).

**The rule for later attempts.** A result's message id names its slot and attempt (``result_msg_id``); a
slot holds one row. A stored result is never replaced. A failure row gives way to a row of a later attempt
(a lost slot is attempt 0, so any row of the slot's own runs replaces it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from gym_runtime.errors import Failure
from gym_runtime.messages import ErrorInfo, RolloutResult
from gym_runtime.observability import logs
from gym_runtime.transport import jetstream
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.delivery import Delivery
from gym_runtime.transport.headers import DIRECT_GET_HEADERS, MSG_ID_HEADER
from gym_runtime.transport.subjects import LOST

log = logs.get("gym.intake")


def replaces(held_ok: bool, held_attempt: int, new: RolloutResult) -> bool:
    """Whether ``new`` takes a slot that holds a row already (a result if ``held_ok``, else a failure row of
    attempt ``held_attempt``): never a result; a failure, by a later attempt's row."""
    return not held_ok and new.attempts > held_attempt


def is_ok(res: RolloutResult) -> bool:
    """A result with a row (else the slot gets a failure row)."""
    return res.error is None and res.row is not None


class Intake:
    """The check every reader of one batch's results makes: ``slot`` gives the slot a stored result may take,
    or None (counted in ``refused``, logged at most once per interval per cause).

    ``allows(task, agent)``: whether ``agent`` owns ``task`` (``TaskOwners.allows``, or a client's own map
    for its runs); ``tasks``: the batch's tasks, None when it is open-ended (``Client.run``).
    """

    def __init__(
        self, bus: Bus, batch: str, *, repeats: int, tasks: int | None, allows: Callable[[int, str], bool]
    ) -> None:
        self.bus = bus
        self.batch = batch
        self.repeats = max(1, repeats)
        self.tasks = tasks
        self.allows = allows
        self.refused = 0

    def slot(self, res: RolloutResult, subject: str, headers: Mapping[str, str] | None) -> int | None:
        parts = self.bus.subjects.result_parts(subject)
        if parts is not None and parts[0] == LOST:
            return None  # a reader's record of a lost slot: each reader decides that from the server's counts
        cause = _not_stored_by_an_agent(res, headers or {}) or self._refusal(res, parts)
        if cause is not None:
            self.refused += 1
            self.bus.warn_limited("result.refused", cause, subject=subject)
            return None
        return res.task_index * self.repeats + res.rollout_index

    def _refusal(self, res: RolloutResult, parts: tuple[str, str] | None) -> str | None:
        if parts is None or parts[1] != self.batch:
            return "not on a result subject of this batch"
        agent = parts[0]
        if res.batch != self.batch:
            return "its batch is not its subject's"
        if res.agent != agent:
            return "its agent is not its subject's"
        if not 0 <= res.rollout_index < self.repeats:
            return "a rollout index the batch does not have"
        if res.task_index < 0 or (self.tasks is not None and res.task_index >= self.tasks):
            return "a task index the batch does not have"
        if not self.allows(res.task_index, agent):
            return "not from the agent that owns the task"
        return None

    def lost_record(self, res: RolloutResult, subject: str, headers: Mapping[str, str] | None) -> int | None:
        """The slot a reader's record of a lost slot names (``status`` shows it as failed), else None."""
        parts = self.bus.subjects.result_parts(subject)
        if parts != (LOST, self.batch) or res.batch != self.batch or _not_stored_by_an_agent(res, headers or {}):
            return None
        if not 0 <= res.rollout_index < self.repeats or res.task_index < 0:
            return None
        if self.tasks is not None and res.task_index >= self.tasks:
            return None
        return res.task_index * self.repeats + res.rollout_index


def _not_stored_by_an_agent(res: RolloutResult, headers: Mapping[str, str]) -> str | None:
    """Why a stored message is not one a worker stored (``js_publish`` with the slot's id), or None."""
    if any(h in headers for h in DIRECT_GET_HEADERS):
        return "a server's answer (a direct get's headers), not a stored result"
    slot = jetstream.result_id_slot(headers.get(MSG_ID_HEADER, ""))
    if slot is None:
        return "no message id naming its slot"
    if slot != (res.batch, res.task_index, res.rollout_index):
        return "its message id names another slot"
    return None


async def read_result(bus: Bus, msg: Delivery) -> RolloutResult | None:
    """A stored result as every reader of the results stream must see it: a body that cannot be read is a
    failure row of the slot its id names (its subject is still checked), never a reward, never a hang."""
    try:
        res, size = await bus.decode_sized(msg)
    except Exception as e:  # a tampered or missing body
        return unreadable_result(bus, msg, e)
    if not isinstance(res, RolloutResult):
        log.warning("result.unexpected", subject=msg.subject, type=type(res).__name__)
        return None
    _weigh(res, size)
    return res


def _weigh(res: RolloutResult, size: int) -> None:
    """Its cost's ``stored_bytes``, from the stored message (a row always gets one; a failure only with a cost
    of its own)."""
    if res.row is None:
        if res.cost is not None:
            res.cost.stored_bytes = size
        return
    cost = res.row.get("cost")
    if isinstance(cost, dict):
        cost["stored_bytes"] = size
    elif cost is None:
        res.row["cost"] = {"stored_bytes": size}


def unreadable_result(bus: Bus, msg: Delivery, e: Exception) -> RolloutResult | None:
    """The failure of a stored result whose body cannot be read, named by its ``Nats-Msg-Id`` and subject;
    ``None`` when they name none (logged: not a result of ours)."""
    slot = jetstream.result_id_slot((msg.headers or {}).get(MSG_ID_HEADER, ""))
    parts = bus.subjects.result_parts(msg.subject)
    if slot is None or parts is None:
        log.warning("result.unreadable", subject=msg.subject, error=str(e))
        return None
    info = e.info if isinstance(e, Failure) else ErrorInfo(error_class="integrity", message=str(e))
    return RolloutResult(
        batch=slot[0],
        task_index=slot[1],
        rollout_index=slot[2],
        agent=parts[0],
        error=ErrorInfo(error_class="integrity", message=f"the stored result cannot be read: {info.message}"),
    )
