"""Call-based comparison in the worker: NeMo Gym's rule on plain values decoded from the sandbox's data."""

from __future__ import annotations

import collections
import enum
import importlib.util
import json
import math
from pathlib import Path

import pytest

from gym_runtime.resources.code_gen.calls import DecodeError, Opaque, Pairs, call_matches, decode, dumps, judge_call

_spec = importlib.util.spec_from_file_location("gym_harness", Path(__file__).resolve().parents[1] / "harness.py")
harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)


def roundtrip(value):
    """What the worker gets for ``value``: encoded in the sandbox, sent as JSON, decoded here."""
    return decode(json.loads(json.dumps(harness.encode(value))))


def test_plain_values_survive_the_trip() -> None:
    for v in [
        None,
        True,
        0,
        -5,
        2**70,
        10**5000,
        1.5,
        "x",
        [1, [2, "a"]],
        (1, 2),
        1 + 2j,
        b"\x00\xff",
    ]:
        got = roundtrip(v)
        assert got == v and type(got) is type(v)
    assert math.isnan(roundtrip(float("nan")))
    # a dict travels as its items in order (no hash table of the model's keys), compared and dumped as a dict
    got = roundtrip({1: "a", "b": [2]})
    assert isinstance(got, Pairs) and got.items == [(1, "a"), ("b", [2])]
    assert call_matches(got, {"1": "a", "b": [2]}) and dumps(got) == json.dumps({1: "a", "b": [2]})
    # a set can never equal JSON data (nor be dumped as JSON): it is not even looked into
    assert isinstance(roundtrip({3, 4}), Opaque) and isinstance(roundtrip(frozenset({5})), Opaque)


def test_nemo_gym_rules() -> None:
    assert call_matches([2, 1], [2, 1])
    assert call_matches((2, 1), [2, 1])  # a returned tuple counts as a list
    assert call_matches({1: 2}, {"1": 2})  # equal json.dumps
    assert call_matches([(1, 2)], [[1, 2]])  # nested tuple: by json.dumps
    assert call_matches(1 / 3 + 1e-9, 0.3333333333)  # np.allclose tolerance
    assert call_matches(float("nan"), float("nan"))  # json.dumps: NaN == NaN
    assert call_matches("1", 1)  # float("1") == 1.0: NeMo Gym's float rule
    assert not call_matches([1], [1, 2]) and not call_matches("a", 1) and not call_matches({3}, [3])


def test_subclasses_travel_as_their_base_value() -> None:
    class Color(enum.IntEnum):
        RED = 3

    class Cheat(int):
        def __eq__(self, other):
            return True

        __hash__ = int.__hash__

    Point = collections.namedtuple("Point", "x y")
    assert call_matches(roundtrip(Color.RED), 3)
    assert call_matches(roundtrip(Point(1, 2)), [1, 2])
    assert call_matches(roundtrip(collections.defaultdict(int, a=1)), {"a": 1})
    assert not call_matches(roundtrip(Cheat(0)), 3)


def test_anything_else_is_opaque_and_equals_nothing() -> None:
    class Anything:
        def __eq__(self, other):
            return True

    got = roundtrip(Anything())
    assert isinstance(got, Opaque) and not call_matches(got, 1) and not call_matches(got, {})
    cyclic: list = []
    cyclic.append(cyclic)
    assert not call_matches(roundtrip(cyclic), [[]])


def test_forged_data_is_rejected() -> None:
    for bad in [
        {"$": "eval", "code": "1"},
        {"$": "int"},
        {"$": "dict", "items": [[[1], 2]]},
        {"$": "dict", "items": [["a", 1], ["a", 1]]},  # a key twice: no real dict sends that
        {"no": "tag"},
    ]:
        with pytest.raises(DecodeError):
            judge_call(json.dumps(bad).encode(), '{"a": 1, "b": 1}')
    with pytest.raises(DecodeError):
        judge_call(b"\xff\xfe", "1")  # not UTF-8


def test_dumps_is_json_dumps() -> None:
    for v in [None, True, 1, -2.5, float("nan"), float("inf"), "é\ud800\n", [1, (2, [3])], {1: 2, "a": None}]:
        assert dumps(v) == json.dumps(v)
    assert dumps({1.5: 1, True: 2, None: 3}) == json.dumps({1.5: 1, True: 2, None: 3})
    for bad in [{1, 2}, b"x", 1j, {(1,): 2}, Opaque("x")]:
        with pytest.raises(TypeError):
            dumps(bad)
