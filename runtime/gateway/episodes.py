"""NeMo Gym 0.7's Environment Server episode protocol, in rows: requests in, results and typed failures out.

NeMo Gym 0.7 collects every rollout through an Environment Server's ``/run``. A flat row (routing modes
``agent`` and ``legacy``) is answered as ``single_agent_turn_legacy`` answers it: the verify response with
``agent_ref``, or a ``_ng_failure_*`` row. A materialized task (``taskset`` mode) arrives as an episode
request (``nemo_gym/episode_types.py``: ``episode_id`` + ``task``) and is answered with an episode response
holding a ``result`` or an ``EpisodeFailure``. Written from those models' fields, not their code.

Our failure classes map onto NeMo Gym's failure kinds (``nemo_gym/failure_kinds.py``) as their one record says
(``data.error_classes``); a class with no counterpart gets the namespaced kind ``gym_runtime:<class>``, which that
module provides for "something the shared vocabulary should not grow a name for".
"""

from __future__ import annotations

import re
from typing import Annotated, Any

import msgspec

from gym_runtime.data.error_classes import CLASSES, Stage

_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
_ATTEMPT_SUFFIX = re.compile(r"-a[1-9][0-9]*$")
MAX_REASON = 2000  # EpisodeFailure.failure_reason's max_length
ENVIRONMENT_SERVER_FAILED = "environment_server_failed"  # the collector's class for an Environment Server's failure
# keys the collector writes itself and refuses in an Environment Server's result
_COLLECTOR_KEYS = ("ng_trajectory", "ng_model_call_capture", "ng_perf")


class EpisodeId(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    rollout_id: Annotated[str, msgspec.Meta(min_length=1, pattern=_ID)]
    attempt: Annotated[int, msgspec.Meta(ge=0)] = 0

    def __post_init__(self) -> None:
        if _ATTEMPT_SUFFIX.search(self.rollout_id):
            raise ValueError("rollout_id must not end with the reserved attempt suffix '-a<N>'")


class TaskId(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    taskset: Annotated[str, msgspec.Meta(min_length=1)]
    task_id: Annotated[str, msgspec.Meta(min_length=1)]


class MaterializedTask(msgspec.Struct, forbid_unknown_fields=True):
    task_id: TaskId
    task_input: dict[str, Any]


class EpisodeRequest(msgspec.Struct, forbid_unknown_fields=True):
    """``BaseEpisodeRequest``: one physical attempt of a rollout of one task."""

    episode_id: EpisodeId
    task: MaterializedTask


class EpisodeFailure(msgspec.Struct, omit_defaults=True):
    """``EpisodeFailure``: why, whether collection may try again, and (when known) what kind and where."""

    failure_reason: str
    terminal: bool
    failure_kind: str | None = None
    stage: Stage | None = None


# error class -> (failure kind, terminal, stage), read from the one record of each class (``data.error_classes``),
# plus the gateway's own: the task was not acknowledged by the bus in time (PublishTimeout)
FAILURES: dict[str, tuple[str, bool, Stage | None]] = {
    **{c: (r.kind, r.terminal, r.stage) for c, r in CLASSES.items()},
    "publish_timeout": ("transport_timeout", False, "admission"),
}


def failure_of(error_class: str, message: str) -> EpisodeFailure:
    """The ``EpisodeFailure`` of one of our failure rows (an unknown class: terminal, unclassified)."""
    kind, terminal, stage = FAILURES.get(error_class, (None, True, None))
    return EpisodeFailure(f"{error_class}: {message}"[:MAX_REASON], terminal, kind, stage)


def decode_request(body: dict[str, Any]) -> EpisodeRequest:
    """An episode request, checked field for field (``msgspec.ValidationError`` naming the field)."""
    return msgspec.convert(body, EpisodeRequest)


def is_episode_request(body: dict[str, Any]) -> bool:
    """Whether a ``/run`` body is an episode request rather than a flat row (as ``single_agent_turn_legacy``
    tells them apart)."""
    return "episode_id" in body and "task" in body


def task_row(task_input: dict[str, Any]) -> dict[str, Any]:
    """The flat row of a task input (``SingleAgentTurnTaskInput``: ``responses_create_params`` and ``task_data``,
    flat fields merged into ``task_data``; a field both inside and outside it with two values is an error)."""
    fields = dict(task_input)
    params = fields.pop("responses_create_params", None)
    data = fields.pop("task_data", {})
    if not isinstance(data, dict):
        raise ValueError("task_input.task_data must be an object")
    for key in fields.keys() & data.keys():
        if fields[key] != data[key]:
            raise ValueError(f"Conflicting task field {key!r} inside and outside task_data")
    if not isinstance(params, dict):
        raise ValueError("task_input.responses_create_params must be an object")
    return {**data, **fields, "responses_create_params": params}


def result_of(row: dict[str, Any]) -> dict[str, Any]:
    """A rollout row as an episode's ``result``: the verify response, without the collector's own keys (the
    collector refuses a result that carries them) and without ``agent_ref`` (a materialized task names none)."""
    return {k: v for k, v in row.items() if not k.startswith("_ng_") and k not in _COLLECTOR_KEYS and k != "agent_ref"}


def episode_response(
    request: EpisodeRequest, *, result: dict[str, Any] | None = None, failure: EpisodeFailure | None = None
) -> dict[str, Any]:
    """``BaseEpisodeResponse``: the request's identities and exactly one of ``result`` or ``failure``."""
    out: dict[str, Any] = {
        "episode_id": msgspec.to_builtins(request.episode_id),
        "task_id": msgspec.to_builtins(request.task.task_id),
    }
    if failure is not None:
        out["failure"] = msgspec.to_builtins(failure)
    else:
        out["result"] = result
    return out


def legacy_failure(failure: EpisodeFailure, agent: str) -> dict[str, Any]:
    """A failed flat row's answer, as ``single_agent_turn_legacy`` gives it (HTTP 200): the collector files it
    under ``environment_server_failed`` in its failures sidecar and retries it on resume unless terminal."""
    out: dict[str, Any] = {
        "_ng_failure_class": ENVIRONMENT_SERVER_FAILED,
        "_ng_failure_terminal": failure.terminal,
        "_ng_failure_message": failure.failure_reason,
        "_ng_failure_stage": failure.stage,
        "agent_ref": {"name": agent},
    }
    if failure.failure_kind is not None:
        out["failure_kind"] = failure.failure_kind
    return out
