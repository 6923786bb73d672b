"""instruction_following: IFEval / IFBench-style verifiable instructions.

Matches NeMo Gym's ``instruction_following`` resources server. A task row names
the instructions the response must follow: ``instruction_id_list``, one
``kwargs`` object per instruction (nulls are dropped; ``null`` means none) and the
``prompt``, either at the top level (legacy rows) or under ``verifier_metadata``
(which wins key by key), plus an optional ``grading_mode``.

The checked text is the first content part of the *last* output item (an empty
text when that item has no content, e.g. a function call). Each instruction is
checked by its own checker (``checkers.CHECKERS``: all 54 ids of NeMo Gym's checker
library, offline); an unknown id or unusable arguments count as not followed.

- ``follow_instruction_list``: one bool per instruction;
- ``follow_all_instructions``: all of them (true for an empty list, as upstream);
- ``reward``: ``binary`` (default) 1.0 iff all are followed; ``fraction`` the
  share followed (0.0 for an empty list).

The checkers run in a worker process (``run_in_process``) with a time limit
(``options.timeout_s``, default 30 s): they tokenize text and run regexes given by
the task, which must never stall the resource worker's event loop.
"""

from __future__ import annotations

from typing import Any

import msgspec

from gym_runtime.messages import Response, last_item_text
from gym_runtime.resource import Resource, Verdict, run_in_process

from .checkers import CHECKERS, follow_list

__all__ = ["CHECKERS", "InstructionFollowing", "grade", "verifier_metadata"]

GRADING_MODES = ("binary", "fraction")
_REQUIRED = ("instruction_id_list", "prompt", "kwargs")


def verifier_metadata(row: dict[str, Any]) -> dict[str, Any]:
    """The row's ``verifier_metadata``, completed from legacy top-level fields; refuses incomplete rows."""
    meta = row.get("verifier_metadata") or {}
    if not isinstance(meta, dict):
        raise ValueError("task row: verifier_metadata must be an object")
    meta = dict(meta)
    for key in (*_REQUIRED, "grading_mode"):
        if key not in meta and key in row:
            meta[key] = row[key]
    missing = [k for k in _REQUIRED if k not in meta]
    if missing:
        raise ValueError(f"task row: verifier_metadata is missing required fields: {missing}")
    if not isinstance(meta["instruction_id_list"], list) or not isinstance(meta["kwargs"], list):
        raise ValueError("task row: instruction_id_list and kwargs must be lists")
    mode = meta.get("grading_mode", "binary")
    if mode not in GRADING_MODES:
        raise ValueError(f"task row: invalid grading_mode {mode!r} (binary or fraction)")
    return meta


def grade(meta: dict[str, Any], text: str) -> tuple[float, bool, list[bool]]:
    """(reward, follow_all_instructions, follow_instruction_list). CPU-bound: run it off the event loop."""
    followed = follow_list(meta["instruction_id_list"], meta["kwargs"], text)
    if meta.get("grading_mode", "binary") == "fraction":
        reward = sum(followed) / len(followed) if followed else 0.0
    else:
        reward = float(all(followed))
    return float(reward), all(followed), followed


class InstructionTask(msgspec.Struct, kw_only=True):
    """The task fields verify reads, top level or under ``verifier_metadata``."""

    instruction_id_list: list[str] | None = None
    kwargs: list[dict[str, Any] | None] | None = None
    prompt: str | None = None
    verifier_metadata: dict[str, Any] | None = None


class InstructionFollowing(Resource):
    """Stateless and single-turn: no tools."""

    task_fields = InstructionTask
    requires = ("nltk", "punkt", "langdetect")
    install = "pip install 'gym-runtime[envs]'"
    check_task = staticmethod(verifier_metadata)

    async def verify(self, task: dict[str, Any], response: Response) -> Verdict:
        meta = verifier_metadata(task)
        timeout = float(self.options.get("timeout_s", 30.0))
        reward, all_followed, followed = await run_in_process(
            grade, meta, last_item_text(response.output), timeout=timeout
        )
        return Verdict(
            reward=reward,
            fields={"follow_all_instructions": all_followed, "follow_instruction_list": followed},
        )
