"""Call-based verdicts, decided in the worker: decode a sandboxed call's result, compare it.

The sandbox sends each result as JSON data tagged by ``harness.encode``; this module
turns it back into plain values (built-in types only, so comparing them runs no code
of the program) and applies NeMo Gym's rule to them: right when
``prediction == expected``, or their ``json.dumps`` are equal, or both convert with
``float()`` and are within ``np.allclose``'s tolerance (rtol 1e-5, atol 1e-8).

The data is the model's, so nothing here may cost more than linear time or more memory
than the expected output justifies:

- *no hash table keyed by the model's values*: Python's ``int``, ``float`` and ``tuple``
  hashes are not randomized, so a set of ints that all hash alike (``k * (2**61 - 1)``)
  costs quadratic time to build. None is built: ``expected`` is JSON (no sets, string
  keys only), so a set in the prediction can never be equal to it, nor be dumped as
  JSON, nor be a float: it decodes to an :class:`Opaque` that equals nothing. A dict
  becomes :class:`Pairs` (its items in order) and is compared item by item against the
  expected dict (whose string keys *are* hashed with Python's randomized string hash);
  ``json.dumps`` of it is written here (:func:`dumps`), the way the stdlib writes it;
- *bounded by the expected output*: a right answer has exactly as many values as the
  expected one (for ``==``, for equal ``json.dumps`` and for ``float()`` alike), and the
  tagged encoding spends at most 4 JSON values on one; a result whose text holds more
  (counted on the raw bytes, before decoding) is wrong without being decoded
  (:func:`judge_call`). So ``[[]] * n`` costs a scan of its bytes, not ``n`` lists;
- *bounded depth*: 256 levels (the honest encoder stops at 200).
"""

from __future__ import annotations

import json
import math
import re
from json.encoder import encode_basestring_ascii as _json_str
from typing import Any


class Opaque:
    """A value the sandbox could not send as data; it equals nothing (not even another Opaque)."""

    __slots__ = ("type",)

    def __init__(self, type_: str) -> None:
        self.type = type_

    def __repr__(self) -> str:
        return f"<{self.type}>"


class Pairs:
    """A dict of the prediction as its items in order (no hash table of the model's keys)."""

    __slots__ = ("items",)

    def __init__(self, items: list[tuple[Any, Any]]) -> None:
        self.items = items

    def __repr__(self) -> str:
        return "{" + ", ".join(f"{k!r}: {v!r}" for k, v in self.items) + "}"


class DecodeError(ValueError):
    """The sandbox sent something no honest encoder produces (the run counts as broken)."""


_MAX_DEPTH = 256
_SCALARS = (bool, int, float, str)


def decode(data: Any, depth: int = 0) -> Any:
    """Plain values from ``harness.encode``'s JSON data (sets as :class:`Opaque`, dicts as :class:`Pairs`)."""
    if depth > _MAX_DEPTH:
        raise DecodeError("nested too deeply")
    if data is None or isinstance(data, _SCALARS):
        return data
    if isinstance(data, list):
        return [decode(v, depth + 1) for v in data]
    if not isinstance(data, dict):
        raise DecodeError(f"unexpected {type(data).__name__}")
    kind = data.get("$")
    try:
        if kind == "tuple":
            return tuple(decode(v, depth + 1) for v in _items_of(data))
        if kind == "dict":
            pairs = []
            names: set[str] = set()  # (string keys only: their hash is randomized)
            for pair in _items_of(data):
                if not isinstance(pair, list) or len(pair) != 2:
                    raise DecodeError("malformed dict item")
                key = decode(pair[0], depth + 1)
                if isinstance(key, (list, Pairs)):
                    raise DecodeError("unhashable dict key")
                if type(key) is str:
                    if key in names:
                        raise DecodeError("repeated dict key")
                    names.add(key)
                pairs.append((key, decode(pair[1], depth + 1)))
            return Pairs(pairs)
        if kind in ("set", "frozenset"):
            _items_of(data)
            return Opaque(kind)  # never equal to JSON data: not even looked into
        if kind == "int":
            return int(data["hex"], 16)
        if kind == "complex":
            return complex(float(data["re"]), float(data["im"]))
        if kind == "bytes":
            return bytes.fromhex(data["hex"])
        if kind == "opaque":
            return Opaque(str(data.get("type")))
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, DecodeError):
            raise
        raise DecodeError(f"malformed {kind}: {e}") from None
    raise DecodeError(f"unknown tag {kind!r}")


def _items_of(data: dict[str, Any]) -> list[Any]:
    items = data["items"]
    if not isinstance(items, list):
        raise DecodeError("items must be a list")
    return items


# ----------------------------------------------------------------------------- NeMo Gym's three rules


def _pairs(value: Any) -> list[tuple[Any, Any]] | None:
    if isinstance(value, Pairs):
        return value.items
    if isinstance(value, dict):
        return list(value.items())
    return None


def equal(p: Any, e: Any) -> bool:
    """``p == e`` as Python decides it, for a plain prediction ``p`` and JSON data ``e``."""
    if e is None:
        return p is None
    if isinstance(e, (int, float)):  # (and bool)
        return isinstance(p, (int, float, complex)) and p == e
    if isinstance(e, str):
        return type(p) is str and p == e
    if isinstance(e, list):
        return type(p) is list and len(p) == len(e) and all(equal(a, b) for a, b in zip(p, e))
    if isinstance(e, dict):
        items = _pairs(p)
        if items is None or len(items) != len(e):
            return False
        # every key must be found in e: only a string can be (e's keys are strings)
        return all(type(k) is str and k in e and equal(v, e[k]) for k, v in items)
    return False


def _float_text(v: float) -> str:
    if v != v:
        return "NaN"
    if v in (math.inf, -math.inf):
        return "Infinity" if v > 0 else "-Infinity"
    return float.__repr__(v)


def _key_text(k: Any) -> str:
    if type(k) is str:
        return k
    if type(k) is float:
        return _float_text(k)
    if k is True or k is False or k is None:
        return {True: "true", False: "false", None: "null"}[k]
    if type(k) is int:
        return int.__repr__(k)
    raise TypeError(f"keys must be str, int, float, bool or None, not {type(k).__name__}")


def dumps(value: Any) -> str:
    """``json.dumps(value)`` (default options) of a plain prediction; TypeError where json.dumps raises one."""
    out: list[str] = []
    _dump(value, out, 0)
    return "".join(out)


def _dump(v: Any, out: list[str], depth: int) -> None:
    if depth > _MAX_DEPTH + 8:
        raise RecursionError("nested too deeply")
    if v is None:
        out.append("null")
    elif v is True:
        out.append("true")
    elif v is False:
        out.append("false")
    elif type(v) is int:
        out.append(int.__repr__(v))  # (ValueError past the interpreter's digit limit, as json.dumps)
    elif type(v) is float:
        out.append(_float_text(v))
    elif type(v) is str:
        out.append(_json_str(v))
    elif type(v) in (list, tuple):
        out.append("[")
        for i, item in enumerate(v):
            if i:
                out.append(", ")
            _dump(item, out, depth + 1)
        out.append("]")
    elif (items := _pairs(v)) is not None:
        out.append("{")
        for i, (k, item) in enumerate(items):
            if i:
                out.append(", ")
            out.append(_json_str(_key_text(k)))
            out.append(": ")
            _dump(item, out, depth + 1)
        out.append("}")
    else:
        raise TypeError(f"Object of type {type(v).__name__} is not JSON serializable")


def _close(a: float, b: float) -> bool:
    """``np.allclose`` for two floats (rtol 1e-5, atol 1e-8, NaN never close)."""
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= 1e-8 + 1e-5 * abs(b)


def call_matches(prediction: Any, expected: Any) -> bool:
    """NeMo Gym's call-based comparison of a plain prediction and JSON data (may raise, e.g. RecursionError)."""
    if isinstance(prediction, tuple):
        prediction = list(prediction)
    if equal(prediction, expected):
        return True
    try:
        if dumps(prediction) == json.dumps(expected):
            return True
    except (TypeError, ValueError, RecursionError):
        pass
    if isinstance(prediction, (bool, int, float, str, bytes)) and isinstance(expected, (bool, int, float, str)):
        try:
            return _close(float(prediction), float(expected))
        except (TypeError, ValueError, OverflowError):
            pass
    return False


# ----------------------------------------------------------------------------- bounded by the expected output

_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


def values_at_least(data: bytes) -> int:
    """A lower bound on the JSON values in ``data``, from its raw bytes (strings left out): linear, no decoding."""
    bare = _JSON_STRING.sub(b"", data)
    return max(bare.count(b",") + 1, bare.count(b"[") + bare.count(b"{"))


def values_in(expected: Any) -> int:
    """How many JSON values ``expected`` holds (itself, and everything inside, keys not counted)."""
    n, todo = 0, [expected]
    while todo:
        v = todo.pop()
        n += 1
        if isinstance(v, list):
            todo.extend(v)
        elif isinstance(v, dict):
            todo.extend(v.values())
    return n


def judge_call(data: bytes, expected_json: str) -> bool:
    """One sent result (``harness.encode``'s JSON as UTF-8 bytes) against one expected output (JSON text).

    A top-level function: it runs inline for small results, in a worker process for big ones.
    """
    expected = json.loads(expected_json)
    if values_at_least(data) > 4 * values_in(expected) + 16:
        return False  # more values than any right answer has: wrong, and never decoded
    try:
        raw = json.loads(data.decode("utf-8", "surrogatepass"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise DecodeError("not JSON") from None
    return call_matches(decode(raw), expected)
