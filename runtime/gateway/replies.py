"""The bodies every gateway app answers with: JSON replies, decoded requests, FastAPI's and NeMo Gym's error shapes."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

_dec = msgspec.json.Decoder()
_enc = msgspec.json.Encoder()
BOOKKEEPING = ("_ng_task_index", "_ng_rollout_index")


def json_reply(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=_enc.encode(body), status=status, content_type="application/json", headers=headers)


def refusal(error: type[web.HTTPException], detail: str, **headers: str) -> web.HTTPException:
    """An HTTP error raised from a handler (or a worker thread) with FastAPI's ``{"detail": ...}`` body."""
    return error(text=_enc.encode({"detail": detail}).decode(), content_type="application/json", headers=headers)


# what a ``/run`` body is, said by every refusal of one (NeMo Gym's row, as the JSONL files of task rows hold it)
TASK_ROW = '{"responses_create_params": {"input": [{"role": "user", "content": "..."}]}, ...} (a task row)'


def decoded(raw: bytes, expected: str = "") -> Any:
    """A request's JSON body, or FastAPI's 422 for one that is not JSON, not UTF-8 or nested too deep (saying
    the ``expected`` shape, when given)."""
    try:
        return _dec.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as e:
        what = "nested too deep" if isinstance(e, RecursionError) else f"not JSON: {e}"
        shape = f"; expected a JSON object: {expected}" if expected else ""
        raise refusal(web.HTTPUnprocessableEntity, f"body is {what}{shape}") from None


def invalid_episode(message: str) -> web.Response:
    """FastAPI's answer to a request body its model refuses: 422, a list of errors."""
    return json_reply({"detail": [{"type": "value_error", "loc": ["body"], "msg": message}]}, 422)


def server_error(message: str) -> web.Response:
    """What NeMo Gym's exception middleware answers for a ``ValueError`` its handler raised: 500, ``repr(e)``."""
    return json_reply(repr(ValueError(message)), 500)


def run_reply(row: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    """What NeMo Gym's ``/run`` answers for ``request``: ``row`` less the collector's bookkeeping."""
    out = {k: v for k, v in row.items() if k not in BOOKKEEPING}
    for k in BOOKKEEPING:
        if k in request:
            out[k] = request[k]
    if "agent_ref" not in request:
        out.pop("agent_ref", None)
    return out
