"""Packed ``unit_tests`` (``{"packed": base64(zlib(json))}``, as NeMo Gym's code_gen rows carry them) unpack to
at most ``max_unit_tests_mb``: a zip bomb is refused within that bound, never the worker's memory.

The bomb is real: 1 GiB of JSON (one test input of zeros) compressed to ~1 MB. Before the bound, unpacking
it allocated the whole GiB (and ``json.loads`` a second copy).
"""

from __future__ import annotations

import base64
import json
import time
import tracemalloc
import zlib
from pathlib import Path
from typing import Any

import pytest

from gym_runtime.errors import Failure
from gym_runtime.resources.code_gen.grading import unit_tests
from gym_runtime.workers.resource_worker import verify_with
from tests.helpers import REPO, cli, read_jsonl, write_jsonl

from .programs import ADD_OK, FAST, fenced, session

GIB = 1 << 30


@pytest.fixture(scope="module")
def bomb() -> str:
    """``{"inputs": ["000…"], "outputs": ["0"]}`` with a 1 GiB input, zlib level 9, base64."""
    z = zlib.compressobj(9)
    parts = [z.compress(b'{"inputs": ["')]
    zeros = b"0" * (1 << 20)
    parts += [z.compress(zeros) for _ in range(GIB >> 20)]
    parts.append(z.compress(b'"], "outputs": ["0"]}') + z.flush())
    packed = b"".join(parts)
    assert len(packed) < 2 << 20  # ~1 MB on the wire
    return base64.b64encode(packed).decode()


def row(packed: str) -> dict[str, Any]:
    first = read_jsonl(REPO / "resources/code_gen/data/example.jsonl")[0]
    return {**first, "verifier_metadata": {"unit_tests": {"packed": packed, "fn_name": None}}}


def test_a_zip_bomb_is_refused_within_the_bound(bomb: str) -> None:
    task = row(bomb)
    tracemalloc.start()
    started = time.monotonic()
    try:
        with pytest.raises(ValueError, match=r"unpacks to more than 64 MB \(code_gen's max_unit_tests_mb\)"):
            unit_tests(task)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak  # counted 1 MiB at a time: the packed text and one chunk, not the GiB
    assert time.monotonic() - started < 10
    tests = {"inputs": ["1 2" * 1000], "outputs": ["3"]}  # 3 KB
    small = base64.b64encode(zlib.compress(json.dumps(tests).encode())).decode()
    assert unit_tests(row(small)).inputs == tests["inputs"]  # an honest packed row still unpacks
    with pytest.raises(ValueError, match="unpacks to more than 0.001 MB"):
        unit_tests(row(small), max_mb=0.001)


@pytest.mark.parametrize(
    ("packed", "why"),
    [
        ("not base64!", "not base64"),
        (base64.b64encode(b"not zlib").decode(), "not base64\\(zlib\\(json\\)\\)"),
        (base64.b64encode(zlib.compress(b'{"inputs": ["1"], "outputs": ["1"]}')[:-6]).decode(), "truncated"),
        (base64.b64encode(zlib.compress(b"[1, 2]")).decode(), "not \\{inputs, outputs\\}"),
    ],
)
def test_malformed_packed_tests_are_one_clear_error(packed: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        unit_tests(row(packed))


async def test_a_zip_bomb_through_verify_is_an_invalid_task_not_a_retried_verify_error(bomb: str) -> None:
    env = await session(**FAST)
    with pytest.raises(Failure) as caught:
        await verify_with(env, row(bomb), fenced(ADD_OK))
    assert caught.value.info.error_class == "invalid_task" and not caught.value.info.retryable
    assert "max_unit_tests_mb" in caught.value.info.message


def test_a_zip_bomb_row_is_one_line_at_validate_and_run_refuses_it(bomb: str, tmp_path: Path) -> None:
    rows = write_jsonl(tmp_path / "bomb.jsonl", [row(bomb)])
    config = str(REPO / "resources/code_gen/config.yaml")
    res = cli("validate", config, "-i", str(rows))
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert "max_unit_tests_mb" in res.stdout + res.stderr
    out = tmp_path / "o.jsonl"
    res = cli("run", config, "-i", str(rows), "-o", str(out), "--no-progress")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert "max_unit_tests_mb" in res.stderr
