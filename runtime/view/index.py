"""A rollouts file's index: each line's offset and length and the fields the pages filter and sort on.

Built once in one pass (each line decoded into a small Struct: the rest of a 40 KB row is skipped, not
built), kept beside the file (``OUT.jsonl.gymview``) and rebuilt only when the file's size or mtime
changed. The pages read the index, and a row's line only when it is shown, so a file of gigabytes is never
all in memory.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from gym_runtime.data.jsonlines import TOO_DEEP, json_value
from gym_runtime.errors import UserError

VERSION = 3
SUFFIX = ".gymview"
CHUNK = 16 << 20
SHOULD = "a rollouts file has one JSON object a line"


class _Ref(msgspec.Struct):
    name: str | None = None


class _ModelCost(msgspec.Struct):
    input_tokens: int = 0
    output_tokens: int = 0
    call_ms: int = 0


class _Cost(msgspec.Struct):
    models: dict[str, _ModelCost] = {}
    tool_ms: int = 0
    sandbox_ms: int = 0
    estimated_cost: float | None = None
    currency: str | None = None


class _Provenance(msgspec.Struct):
    env: str | None = None
    config: str | None = None
    parts: dict[str, str] = {}
    grader: str | None = None
    images: list[str] = []
    image_ids: list[str] = []


def provenance_parts(prov: _Provenance | None) -> dict[str, str]:
    """The parts of a row's ``provenance`` a diff compares, each a string: ``parts`` (per-part digests:
    ``agent``, ``model.NAME``, ``resource``) where recorded, else the one ``config`` hash; the environment's
    code, the grader, the images."""
    if prov is None:
        return {}
    out = dict(prov.parts) if prov.parts else ({"config": prov.config} if prov.config is not None else {})
    if prov.env is not None:
        out["env"] = prov.env
    if prov.grader is not None:
        out["grader"] = prov.grader
    if prov.image_ids or prov.images:
        out["images"] = ",".join(prov.image_ids or prov.images)
    return out


class _Params(msgspec.Struct):
    input: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)  # (empty: absent; Raw takes no union)
    instructions: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)


class _Task(msgspec.Struct):
    responses_create_params: _Params | None = None


class _Row(msgspec.Struct):
    """What the index keeps of a row (a failure row's ``error_class`` too); every other key is skipped."""

    reward: float | None = None
    agent_ref: _Ref | None = None
    resources_server_ref: _Ref | None = None
    task: int | None = msgspec.field(default=None, name="_ng_task_index")
    rollout: int | None = msgspec.field(default=None, name="_ng_rollout_index")
    error_class: str | None = None
    policy_versions: list[int] | None = None
    cost: _Cost | None = None
    provenance: _Provenance | None = None
    responses_create_params: _Params | None = None
    input: _Task | None = None  # a failure row's task row


_decode_row = msgspec.json.Decoder(_Row).decode


class Index(msgspec.Struct, array_like=True):
    """One file's index: columns, one entry per line (``names`` holds the strings the int columns point at)."""

    version: int
    size: int
    mtime_ns: int
    names: list[str]
    offsets: list[int]
    lengths: list[int]
    task: list[int]  # -1: none
    rollout: list[int]
    agent: list[int]  # into names
    env: list[int]
    error_class: list[int]  # -1: none (a row, not a failure)
    reward: list[float]  # NaN: none
    pv_min: list[int]  # -1: none
    pv_max: list[int]
    busy_ms: list[int]  # model call time + tool time + sandbox time
    tokens: list[int]  # input + output tokens over every model entry
    cost: list[float]  # NaN: no estimate
    currency: list[int]  # into names, -1 none
    provenance: list[int]  # into names: ``provenance_parts`` as JSON, -1 none
    prompt: list[int] = []  # a checksum of the task's input as written, -1 none (``diff``'s task identity)
    unreadable: dict[int, str] = {}  # line -> why it cannot be read (only in an index rebuilt while viewed)

    def __len__(self) -> int:
        return len(self.offsets)

    def name(self, i: int) -> str:
        return self.names[i] if i >= 0 else ""

    def parts(self, i: int) -> dict[str, str]:
        """Line ``i``'s provenance parts (``provenance_parts``)."""
        p = self.provenance[i]
        return msgspec.json.decode(self.names[p]) if p >= 0 else {}


def index_path(path: Path) -> Path:
    return path.with_name(path.name + SUFFIX)


_FIELDS = {f.encode_name: f for f in msgspec.structs.fields(_Row)}


def _lenient(value: dict[str, Any]) -> _Row:
    """A row whose fields have other types than ours (a string reward, a list agent_ref), or with a lone
    surrogate escape (parsed by the stdlib): what fits, kept."""
    row = _Row()
    for key, f in _FIELDS.items():
        if key in value and f.name not in ("responses_create_params", "input"):  # (Raw: not from builtins)
            with contextlib.suppress(msgspec.ValidationError):
                setattr(row, f.name, msgspec.convert(value[key], f.type))
    reward = value.get("reward")
    if isinstance(reward, (int, float)) and not isinstance(reward, bool) and row.reward is None:
        row.reward = _as_float(reward)  # 10**400, 1e400: as they are (infinite), not dropped
    return row


def _as_float(v: int | float) -> float:
    try:
        return float(v)
    except OverflowError:
        return math.inf if v > 0 else -math.inf


class Builder:
    """An index built line by line (``build``; ``view``'s live mode, as rows arrive)."""

    def __init__(self, size: int, mtime_ns: int) -> None:
        lists: list[list[int]] = [[] for _ in Index.__struct_fields__[4:-1]]
        self.ix = Index(VERSION, size, mtime_ns, [], *lists, {})  # type: ignore[arg-type,call-arg]
        self._ids: dict[str, int] = {}

    @classmethod
    def extend(cls, ix: Index, size: int, mtime_ns: int) -> Builder:
        """A builder that goes on from ``ix`` (a file that grew)."""
        b = cls(size, mtime_ns)
        b.ix = msgspec.structs.replace(
            ix,
            size=size,
            mtime_ns=mtime_ns,
            names=list(ix.names),
            unreadable=dict(ix.unreadable),
            **{f: list(getattr(ix, f)) for f in Index.__struct_fields__[4:-1]},
        )
        b._ids = {n: i for i, n in enumerate(ix.names)}
        return b

    def _id(self, name: str | None) -> int:
        if not name:
            return -1
        i = self._ids.get(name)
        if i is None:
            i = self._ids[name] = len(self.ix.names)
            self.ix.names.append(name)
        return i

    def add(self, offset: int, line: bytes, where: str, *, lenient: bool = False) -> None:
        """Index one line; one that cannot be read is the user's mistake naming ``where`` (``lenient``: kept as
        an empty row with the reason, for a file that changed while it is viewed)."""
        try:
            r = read_row(line, where)
        except UserError as e:
            if not lenient:
                raise
            self.ix.unreadable[len(self.ix.offsets)] = str(e)
            r = _Row()
        ix = self.ix
        ix.offsets.append(offset)
        ix.lengths.append(len(line))
        ix.task.append(_i64(r.task) if r.task is not None else -1)
        ix.rollout.append(_i64(r.rollout) if r.rollout is not None else -1)
        ix.agent.append(self._id(r.agent_ref.name if r.agent_ref else None))
        env = r.resources_server_ref.name if r.resources_server_ref else None
        ix.env.append(self._id(env or (r.provenance.env if r.provenance else None)))
        ix.error_class.append(self._id(r.error_class))
        ix.reward.append(float(r.reward) if r.reward is not None else math.nan)
        pv = r.policy_versions or []
        ix.pv_min.append(_i64(min(pv)) if pv else -1)
        ix.pv_max.append(_i64(max(pv)) if pv else -1)
        c = r.cost
        if c is None:
            ix.busy_ms.append(0)
            ix.tokens.append(0)
            ix.cost.append(math.nan)
            ix.currency.append(-1)
        else:
            models = c.models.values()
            ix.busy_ms.append(_i64(sum(m.call_ms for m in models) + c.tool_ms + c.sandbox_ms))
            ix.tokens.append(_i64(sum(m.input_tokens + m.output_tokens for m in models)))
            ix.cost.append(c.estimated_cost if c.estimated_cost is not None else math.nan)
            ix.currency.append(self._id(c.currency))
        parts = provenance_parts(r.provenance)
        ix.provenance.append(self._id(msgspec.json.encode(parts, order="sorted").decode()) if parts else -1)
        ix.prompt.append(_prompt(r))


def _i64(v: int) -> int:
    """An integer column's entry: a 40-digit count or id (JSON has no bound) held at the index's 64-bit edge."""
    return max(-(2**63), min(v, 2**63 - 1))


def read_row(line: bytes, where: str) -> _Row:
    """What the index keeps of one line; a line that is not a JSON object, not UTF-8 or too deep is the
    user's mistake, one line naming ``where``."""
    if not line.isascii():  # (msgspec skips a field it does not keep without checking its bytes)
        try:
            line.decode()
        except UnicodeDecodeError as e:
            raise UserError(
                f"{where}: not UTF-8 ({e.reason} at byte {e.start}); a rollouts file is UTF-8 JSON"
            ) from None
    try:
        return _decode_row(line)
    except RecursionError:
        raise UserError(f"{where}: {TOO_DEEP}; {SHOULD}") from None
    except (msgspec.ValidationError, msgspec.DecodeError):
        pass
    value = json_value(line, where, SHOULD)  # the stdlib's parser: it keeps a lone surrogate (msgspec refuses one)
    if not isinstance(value, dict):
        raise UserError(f"{where}: not a JSON object; {SHOULD}")
    return _lenient(value)


def _prompt(r: _Row) -> int:
    """A checksum of the row's task input (``responses_create_params.input`` and ``instructions``; a failure
    row's from its ``input`` task row) as written; -1: none. Two writers may write one input apart (spacing,
    escapes): ``diff`` reads both rows whole before it calls their inputs different."""
    params = r.responses_create_params or (r.input.responses_create_params if r.input else None)
    if params is None or not (params.input or params.instructions):
        return -1
    return zlib.crc32(bytes(params.instructions), zlib.crc32(bytes(params.input)))


def lines(path: Path, start: int = 0) -> Iterator[tuple[int, int, bytes]]:
    """(line number from 1, byte offset, line without its newline) of each non-blank line, read in chunks
    (from byte ``start``, a line's start: numbered from there)."""
    offset = start
    number = 0
    rest = b""
    with path.open("rb") as f:
        f.seek(start)
        while True:
            chunk = f.read(CHUNK)
            if not chunk:
                break
            buf = rest + chunk if rest else chunk
            start = 0
            while True:
                end = buf.find(b"\n", start)
                if end < 0:
                    break
                number += 1
                if end > start and not buf[start:end].isspace():
                    yield number, offset + start, buf[start:end]
                start = end + 1
            offset += start
            rest = buf[start:]
        if rest.strip():
            yield number + 1, offset, rest


def build(path: Path, *, lenient: bool = False) -> Index:
    st = path.stat()
    b = Builder(st.st_size, st.st_mtime_ns)
    for number, offset, line in lines(path):
        b.add(offset, line, f"{path}:{number}", lenient=lenient)
    return b.ix


def update(path: Path, ix: Index) -> Index:
    """``ix`` brought up to date with ``path`` as it is now, for a file that changed while it is viewed: a
    file that only grew (its indexed lines as they were: the old end was a line's end) is indexed from there,
    up to its last whole line (a line still being written waits for its newline; ``ix`` itself when no whole
    line came); any other change, rebuilt. A line that cannot be read is kept as an empty row with the reason
    (``unreadable``): the page says so, the rest stays viewable."""
    st = path.stat()
    if st.st_size >= ix.size and _ends_a_line(path, ix.size):
        end = _last_line_end(path, st.st_size)
        if end <= ix.size:
            return ix
        b = Builder.extend(ix, end, st.st_mtime_ns)
        number = _count_lines(path, ix.size)
        for n, offset, line in lines(path, start=ix.size):
            if offset >= end:
                break
            b.add(offset, line, f"{path}:{number + n}", lenient=True)
        return b.ix
    return build(path, lenient=True)


def _last_line_end(path: Path, size: int) -> int:
    """The offset just past the last newline of the file's first ``size`` bytes (0: none)."""
    with path.open("rb") as f:
        pos = size
        while pos > 0:
            start = max(0, pos - (1 << 16))
            f.seek(start)
            found = f.read(pos - start).rfind(b"\n")
            if found >= 0:
                return start + found + 1
            pos = start
    return 0


def _ends_a_line(path: Path, size: int) -> bool:
    if size == 0:
        return True
    with path.open("rb") as f:
        f.seek(size - 1)
        return f.read(1) == b"\n"


def _count_lines(path: Path, size: int) -> int:
    n = 0
    with path.open("rb") as f:
        while size > 0:
            chunk = f.read(min(CHUNK, size))
            if not chunk:
                break
            n += chunk.count(b"\n")
            size -= len(chunk)
    return n


def load(path: Path) -> Index:
    """The file's index: the one kept beside it when it is current, else built now (and kept, where the
    folder is writable: a read-only folder's is built on each start)."""
    st = path.stat()
    kept = index_path(path)
    with contextlib.suppress(OSError, msgspec.DecodeError, msgspec.ValidationError):
        ix = msgspec.msgpack.decode(kept.read_bytes(), type=Index)
        if (ix.version, ix.size, ix.mtime_ns) == (VERSION, st.st_size, st.st_mtime_ns):
            return ix
    ix = build(path)
    tmp = kept.with_name(kept.name + f".{os.getpid()}.tmp")
    try:
        tmp.write_bytes(msgspec.msgpack.encode(ix))
        os.replace(tmp, kept)
    except (OSError, UnicodeEncodeError):  # (a name with a lone surrogate: indexed, not kept)
        with contextlib.suppress(OSError):
            tmp.unlink()
    return ix


def read_line(path: Path, ix: Index, i: int) -> bytes:
    with path.open("rb") as f:
        f.seek(ix.offsets[i])
        return f.read(ix.lengths[i])


def search(path: Path, ix: Index, needle: str, among: list[int]) -> list[int]:
    """The lines of ``among`` whose JSON text holds ``needle`` (ASCII letters in any case): as written raw (UTF-8) and
    as JSON escapes it (``\\u00e9``), so both writers' files match."""
    needle = needle.lower()  # (a line's bytes are lowered as ASCII: its other letters match as written)
    forms = {msgspec.json.encode(needle)[1:-1], _ascii_json(needle)}
    found = []
    with path.open("rb") as f:
        for i in among:
            f.seek(ix.offsets[i])
            text = f.read(ix.lengths[i]).lower()
            if any(form in text for form in forms):
                found.append(i)
    return found


def _ascii_json(s: str) -> bytes:
    return json.dumps(s)[1:-1].encode()
