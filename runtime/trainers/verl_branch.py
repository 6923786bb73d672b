"""verl's ``n`` samples of a prompt as one branch group: ``GymAgentLoop(branch_at=k)`` (issue 78).

verl runs a prompt's ``rollout.n`` samples as ``n`` agent loops that share the prompt's ``uid``, in one actor process:
v1's ``AgentLoopWorkerTQ`` starts them together (``_run_prompt``), the legacy ``AgentLoopWorker`` gets them as
consecutive samples of its chunk. The first loop of a uid in the process is the group's parent: one rollout of the
row, its checkpoints kept (``rows.branch_keep_s``); every other loop of that uid waits for it, then branches it at
model turn ``k`` into one continuation of its own (``Client.branch``, ``m=1``). So the group is a tree, as TRL's
``branch_at`` makes it, and verl's GRPO (``gym_grpo``), which groups by uid, compares the continuations of one state.

What each member hands verl is cut at the branch point (``rows.branched``): its prompt ids the shared prefix (the
task's prompt, turns 1 to ``k`` and their tool outputs), its response only what it generated after turn ``k``, so the
prefix is never trained and every member's prompt is the same ids. A legacy step whose prompts' samples would be
split between two actors (two trees under one uid) is stopped at the start: ``check_workers``
(``GymAgentLoopManager``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio

from gym_runtime.client import Client
from gym_runtime.errors import ClientError
from gym_runtime.trainers.rows import TokenSequence, branch_keep_s, branched

__all__ = ["BRANCH_GROUPS", "TARGET", "BranchGroups", "Point", "branch", "check_workers", "cut", "parent_rollout"]

TARGET = "gym_runtime.trainers.verl.GymAgentLoop"  # the agent loop's ``_target_`` in verl's config


@dataclass
class Point:
    """A group's branch point: its parent rollout (``batch:task:rollout``), the model turn, that rollout's row,
    and the row's sequence cut at the turn (None: no generation after it, or no tokens)."""

    parent: str
    turn: int
    row: dict[str, Any]
    seq: TokenSequence | None


@dataclass
class _Group:
    """One uid's group in this process: its branch point once the parent has it (``ready``), or the parent's error."""

    ready: anyio.Event = field(default_factory=anyio.Event)
    point: Point | None = None
    error: BaseException | None = None
    members: int = 0

    async def wait(self) -> Point:
        await self.ready.wait()
        if self.point is None:  # the parent's loop raised: its members fail the same way (verl's step fails)
            raise ClientError(f"branch_at: the group's parent rollout failed ({self.error or 'no branch point'})")
        return self.point


class BranchGroups:
    """The groups of this process's loops, by uid: the first loop of a uid is its parent; a group is forgotten when
    its last member leaves (verl starts a prompt's samples together, so none joins after)."""

    def __init__(self) -> None:
        self._groups: dict[str, _Group] = {}

    @contextlib.contextmanager
    def joined(self, uid: str) -> Iterator[tuple[_Group, bool]]:
        group = self._groups.get(uid)
        parent = group is None
        if group is None:
            group = self._groups[uid] = _Group()
        group.members += 1
        try:
            yield group, parent
        except BaseException as e:
            if parent:
                group.error = e
            raise
        finally:
            if parent and not group.ready.is_set():  # the parent ended without a branch point: its members fail
                group.ready.set()
            group.members -= 1
            if not group.members:
                del self._groups[uid]

    def __len__(self) -> int:
        return len(self._groups)


# The actor process's groups: the one place its loops of one uid find each other.
BRANCH_GROUPS = BranchGroups()


async def parent_rollout(client: Client, row: dict[str, Any], agent: str | None, ran: list[str]) -> dict[str, Any]:
    """One rollout of ``row`` with its checkpoints kept for the branches; its id appended to ``ran``."""
    keep = branch_keep_s(client.config.jetstream.checkpoint_ttl_s)
    handle = await client.submit([row], agent=agent, keep_checkpoints_s=keep)
    ran.append(f"{handle.batch}:0:0")
    (got,) = await handle.gather()
    return got


async def branch(client: Client, row: dict[str, Any], point: str, turn: int, agent: str | None) -> dict[str, Any]:
    """One continuation of ``point`` at model turn ``turn``."""
    handle = await client.branch(row, parent=point, turn=turn, m=1, agent=agent)
    (got,) = await handle.gather()
    return got


def cut(row: dict[str, Any], turn: int) -> TokenSequence | None:
    """``row``'s sequence past the branch point; None when it has no generation after it (masked, as an excluded
    member is)."""
    try:
        return branched(row, turn)
    except ClientError:
        return None


def check_workers(entries: Iterable[Mapping[str, Any]], batch_size: int, workers: int) -> None:
    """Under verl's legacy trainer: a ``GymAgentLoop`` entry with ``branch_at`` and a step's prompts that verl's
    ``AgentLoopManager`` cannot split evenly between its workers (equal chunks of the repeated batch, one per worker:
    a prompt's samples would run in two actors, two trees under one uid) is one ``ClientError`` line."""
    branching = [e for e in entries if e.get("_target_") == TARGET and e.get("branch_at") is not None]
    if branching and workers > 0 and batch_size % workers:
        raise ClientError(
            f"branch_at: data.train_batch_size {batch_size} is not a multiple of "
            f"actor_rollout_ref.rollout.agent.num_workers {workers}: verl's legacy AgentLoopManager would split some "
            "prompts' samples between two workers, each branching a rollout of its own; make it a multiple"
        )
