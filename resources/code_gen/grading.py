"""The worker side of code_gen grading: what NeMo Gym's ``code_gen`` decides outside the program run.

- ``gym_runtime.messages.output_text``: the text that is graded (``Response.output_text``).
- :func:`extract_code`: the program (the block between the last two lines that
  contain a code fence).
- :func:`compare_stdout`: a stdin/stdout test's verdict from the captured output.
- :func:`run_unit_tests`: one sandboxed run of ``harness.py`` over all tests,
  returning NeMo Gym's ``(result, metadata)``; every verdict is decided here
  from the raw outputs the sandbox sends (call results: :mod:`.calls`).
- :func:`reasoning_format_violation`: the ``<think>``-tag check.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import json
import os
import re
import zlib
from collections.abc import Iterator
from decimal import Decimal
from typing import Any, Literal

import anyio
import anyio.to_process
import msgspec

from gym_runtime.jail import (
    JailBodyTooLarge,
    JailError,
    JailExited,
    JailRunner,
    JailSession,
    JailTimeout,
    Limits,
)
from gym_runtime.messages import Reasoning, Response

from .calls import DecodeError, judge_call

HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness.py")


# ----------------------------------------------------------------------------- the response


def extract_code(text: str) -> str:
    """The lines between the last two lines that contain a code fence; "" with fewer than two.

    The fence's language tag is not looked at: a ```cpp block is extracted (and then
    fails to run as Python), and code without fences is not extracted at all.
    """
    lines = text.split("\n")
    fences = [i for i, line in enumerate(lines) if "```" in line]
    if len(fences) < 2:
        return ""
    return "\n".join(lines[fences[-2] + 1 : fences[-1]])


def reasoning_format_violation(response: Response, final_text: str) -> bool:
    """``<think>``/``</think>`` in the answer text, or either tag more than once in the reasoning summaries."""
    if "<think>" in final_text or "</think>" in final_text:
        return True
    reasoning = ""
    for item in response.output:
        if isinstance(item, Reasoning):
            for part in item.summary or []:
                text = part.get("text") if isinstance(part, dict) else None
                if isinstance(text, str):
                    reasoning += text
    return reasoning.count("<think>") > 1 or reasoning.count("</think>") > 1


# ----------------------------------------------------------------------------- the tests


class UnitTests(msgspec.Struct):
    """LiveCodeBench's test format: parallel lists of inputs and outputs; ``fn_name`` for call-based tasks."""

    inputs: list[str]
    outputs: list[str]
    fn_name: str | None = None


MAX_UNPACKED_MB = 64.0  # default max_unit_tests_mb: what a packed unit_tests may unpack to


def unit_tests(task: dict[str, Any], *, max_mb: float = MAX_UNPACKED_MB) -> UnitTests:
    """The task's ``verifier_metadata.unit_tests``, also in the compressed ``{"packed": ...}`` form, which
    may unpack to at most ``max_mb`` MB (a zip bomb is a ``ValueError``, never the worker's memory)."""
    meta = task.get("verifier_metadata")
    if not isinstance(meta, dict) or "unit_tests" not in meta:
        raise ValueError("task row: verifier_metadata.unit_tests is missing")
    raw = meta["unit_tests"]
    if isinstance(raw, dict) and "packed" in raw:
        decoded = _unpack(raw["packed"], max_mb)
        if not isinstance(decoded, dict) or "inputs" not in decoded or "outputs" not in decoded:
            raise ValueError("task row: verifier_metadata.unit_tests.packed: not {inputs, outputs}")
        raw = {"inputs": decoded["inputs"], "outputs": decoded["outputs"], "fn_name": raw.get("fn_name")}
    try:
        return msgspec.convert(raw, UnitTests)
    except msgspec.ValidationError as e:
        raise ValueError(f"task row: verifier_metadata.unit_tests: {e}") from None


def _unpack(packed: Any, max_mb: float) -> Any:
    """base64(zlib(json)) → the JSON value, unpacking at most ``max_mb`` MB.

    The size is counted first, 1 MiB at a time with nothing kept, so a zip bomb costs 1 MiB and stops at the
    bound; a body within it is then unpacked in one buffer of its exact size.
    """
    where = "task row: verifier_metadata.unit_tests.packed"
    limit = int(max_mb * (1 << 20))
    try:
        compressed = base64.b64decode(packed, validate=True)
        inflate = zlib.decompressobj()
        size = len(inflate.decompress(compressed, 1 << 20))
        while inflate.unconsumed_tail and size <= limit:
            size += len(inflate.decompress(inflate.unconsumed_tail, 1 << 20))
        if size > limit:
            raise ValueError(f"{where}: unpacks to more than {max_mb:g} MB (code_gen's max_unit_tests_mb)")
        if not inflate.eof:
            raise ValueError(f"{where}: the compressed data is truncated")
        data = zlib.decompress(compressed, bufsize=max(size, 1))
    except zlib.error as e:
        raise ValueError(f"{where}: not base64(zlib(json)): {e}") from None
    except (TypeError, binascii.Error) as e:
        raise ValueError(f"{where}: not base64(zlib(json)): {e}") from None
    try:
        return json.loads(data)
    except ValueError as e:
        raise ValueError(f"{where}: not JSON: {e}") from None


def shorten(value: Any, length: int = 300) -> str:
    text = value if isinstance(value, str) else str(value)
    if len(text) <= length:
        return text
    return text[: length // 2] + "...(truncated) ..." + text[-length // 2 :]


# The output is compared where it lies, by bounds (a program's output may be the cap's size: a copy of each
# line, or a Decimal per token, multiplied it ~70x); whitespace is str.strip's and str.split's (re's \s is too).
_NON_SPACE = re.compile(r"\S")
_TOKEN = re.compile(r"\S+")


def _stripped(text: str, start: int, end: int) -> tuple[int, int]:
    """The bounds of ``text[start:end].strip()``, copying at most 4 KiB of it."""
    first = _NON_SPACE.search(text, start, end)
    if first is None:
        return start, start
    start = first.start()
    while True:  # back over the trailing whitespace a chunk at a time; text[start] is not whitespace
        chunk = text[max(start, end - 4096) : end]
        kept = len(chunk.rstrip())
        if kept:
            return start, end - len(chunk) + kept
        end -= len(chunk)


def _lines(text: str) -> Iterator[tuple[int, int]]:
    """The bounds of each of ``[line.strip() for line in text.strip().split("\n")]``."""
    start, end = _stripped(text, 0, len(text))
    while True:
        nl = text.find("\n", start, end)
        yield _stripped(text, start, end if nl < 0 else nl)
        if nl < 0:
            return
        start = nl + 1


def _numbers(tokens: Iterator[re.Match[str]]) -> bool:
    try:
        for tok in tokens:
            Decimal(tok.group())
    except Exception:  # as NeMo Gym's rule: whatever Decimal refuses is not a number
        return False
    return True


def _same_numbers(text: str, start: int, end: int, want: str) -> bool:
    """NeMo Gym's rule for a line that differs as text: as many tokens as ``want``, every one of both a
    ``Decimal``, equal in order (an sNaN compared raises there too). Reads no more of the line than ``want``
    has tokens, and holds one token of it at a time."""
    n = sum(1 for _ in _TOKEN.finditer(want))
    if sum(1 for _ in itertools.islice(_TOKEN.finditer(text, start, end), n + 1)) != n:
        return False
    if not (_numbers(_TOKEN.finditer(text, start, end)) and _numbers(_TOKEN.finditer(want))):
        return False
    pairs = zip(_TOKEN.finditer(text, start, end), _TOKEN.finditer(want))
    return all(Decimal(g.group()) == Decimal(w.group()) for g, w in pairs)


def _shorten_span(text: str, start: int, end: int, length: int = 300) -> str:
    """``shorten(text[start:end])`` without copying more of it than it keeps."""
    if end - start <= length:
        return text[start:end]
    return text[start : start + length // 2] + "...(truncated) ..." + text[end - length // 2 : end]


def compare_stdout(prediction: str, gt_inp: str, gt_out: str) -> dict[str, Any] | None:
    """None when the output is accepted, else NeMo Gym's wrong-answer metadata.

    Both texts are stripped and split into lines, each line stripped; the line
    counts must agree; each line must be equal as text or, token by token, as
    ``Decimal`` numbers (so ``3.0`` equals ``3``, ``1e3`` equals ``1000``; no
    tolerance). May raise (e.g. ``decimal.InvalidOperation`` comparing an sNaN),
    which, as under NeMo Gym, fails the whole run with ``Error during testing``.
    Memory beyond the output itself is linear in the expected output (plus one token).
    """
    want = [gt_out[s:e] for s, e in _lines(gt_out)]
    meta: dict[str, Any] = {
        "output": shorten(prediction),
        "inputs": shorten(gt_inp),
        "expected": shorten(gt_out),
        "error_code": -2,
    }
    start, end = _stripped(prediction, 0, len(prediction))
    if prediction.count("\n", start, end) + 1 != len(want):
        meta["error_message"] = "Wrong answer: mismatched output length"
        return meta
    for idx, ((s, e), w) in enumerate(zip(_lines(prediction), want)):
        if e - s == len(w) and prediction.startswith(w, s, e):
            continue
        if _same_numbers(prediction, s, e, w):
            continue
        got = _shorten_span(prediction, s, e)
        meta["error_message"] = f"Wrong answer at output_line_idx={idx}: {got} != {shorten(w)}"
        return meta
    return None


# ----------------------------------------------------------------------------- one run


def global_timeout(timeout: float, n_tests: int) -> float:
    """NeMo Gym's whole-run limit: ``(timeout + 1) * len(inputs) + 5`` seconds."""
    return (timeout + 1) * n_tests + 5


class _Loading(msgspec.Struct, tag_field="kind", tag="loading", forbid_unknown_fields=True):
    pass


class _Ready(msgspec.Struct, tag_field="kind", tag="ready", forbid_unknown_fields=True):
    pass


class _Unprepared(msgspec.Struct, tag_field="kind", tag="unprepared", forbid_unknown_fields=True):
    error: str


class _Output(msgspec.Struct, tag_field="kind", tag="output", forbid_unknown_fields=True):
    """One test's raw output, in the body: captured stdout (UTF-8), or a call's result as data (JSON)."""

    body: int
    overflow: bool = False
    text: str | None = None
    text_error: list[str] | None = None


class _Error(msgspec.Struct, tag_field="kind", tag="error", forbid_unknown_fields=True):
    code: Literal[-3, -4]
    error: str
    traceback: str | None = None


class _Done(msgspec.Struct, tag_field="kind", tag="done", forbid_unknown_fields=True):
    execution_time: float


_Message = _Loading | _Ready | _Unprepared | _Output | _Error | _Done


class _OutOfTime(Exception):
    """The worker's own clock for one test (or for loading the program) ran out."""


def grace(timeout: float) -> float:
    """How much longer than ``timeout`` the worker waits for a test's message (its travel, not the program's)."""
    return 0.25 + 0.1 * timeout


async def _expect(s: JailSession, *kinds: type, budget: float | None = None, max_body: int = 0) -> Any:
    """The next message, which must be one of ``kinds``; anything else ends the run without a verdict.

    ``budget``: seconds the worker waits for it (``_OutOfTime`` after). Returns ``(message, body)``.
    """
    try:
        with anyio.fail_after(budget):
            raw, body = await s.recv(max_body=max_body)
    except TimeoutError:
        raise _OutOfTime from None
    try:
        msg = msgspec.convert(raw, _Message)
    except msgspec.ValidationError:
        raise JailExited("malformed message", None, "") from None
    if not isinstance(msg, kinds):
        raise JailExited(f"unexpected {type(msg).__name__[1:].lower()} message", None, "")
    return msg, body


# Outputs bigger than this are decoded and compared in a worker process, under a time budget;
# smaller ones inline (every step is linear in the size: this bounds what one test costs the loop).
INLINE_COMPARE_BYTES = 64 << 10


def compare_budget(size: int) -> float:
    """Seconds a comparison in a worker process may take: generous for linear work on ``size`` bytes."""
    return 10.0 + size / (1 << 20)


class Comparer:
    """Where comparisons run: inline when small, else in worker processes, ``slots`` at once per worker.

    The clock of a comparison starts when it has a process: a queue behind other rollouts'
    comparisons is not charged to it.
    """

    def __init__(self, slots: int) -> None:
        self._slots = anyio.CapacityLimiter(max(1, slots))
        self._pool = anyio.CapacityLimiter(max(1, slots))

    async def __call__(self, size: int, fn: Any, *args: Any) -> Any:
        if size <= INLINE_COMPARE_BYTES:
            return fn(*args)
        async with self._slots:
            with anyio.fail_after(compare_budget(size)):
                try:
                    return await anyio.to_process.run_sync(fn, *args, cancellable=True, limiter=self._pool)
                except anyio.BrokenWorkerProcess:  # an idle pooled worker that died: once more, fresh
                    return await anyio.to_process.run_sync(fn, *args, cancellable=True, limiter=self._pool)


def _error_meta(msg: _Error, gt_inp: Any, gt_out: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "error": msg.error,
        "error_code": msg.code,
        "error_message": "Time Limit Exceeded" if msg.code == -3 else "Runtime Error",
        "inputs": shorten(gt_inp),
        "expected": shorten(gt_out),
    }
    if msg.code != -3:
        meta["traceback"] = msg.traceback
    return meta


_TIMED_OUT = _Error(code=-3, error="TimeoutException()")


def _during_testing(e: BaseException) -> tuple[list[int | bool], dict[str, Any]]:
    return [-4], {"error_code": -4, "error_message": f"Error during testing: {e}"}


def stdio_judgement(body: bytes, gt_inp: str, gt_out: str) -> dict[str, Any] | None:
    """Decode a captured stdout and compare it (a top-level function: it can run in a worker process)."""
    try:
        prediction = body.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        raise _Undecodable from None
    return compare_stdout(prediction, gt_inp, gt_out)


class _Undecodable(ValueError):
    """The output is not what the harness sends (not UTF-8): the run is broken."""


async def run_unit_tests(
    runner: JailRunner,
    code: str,
    tests: UnitTests,
    *,
    timeout: float,
    limits: Limits,
    output_cap: int,
    comparer: Comparer | None = None,
) -> tuple[list[int | bool], dict[str, Any] | None]:
    """Run ``code`` against ``tests`` in one sandboxed process; NeMo Gym's ``(result, metadata)``.

    The sandbox only ever sees the inputs and only ever sends raw outputs: every
    verdict is decided here, test by test (the sandbox waits for "go on" after
    each, so tests stop at the first failure as under NeMo Gym). The worker keeps
    its own clock: a test whose output does not arrive within ``timeout`` (plus
    :func:`grace`) is a time limit (-3), a load that does not finish in that time
    NeMo Gym's failed preparation (``[-4]``), whatever the program did to its
    timer. A run that ends without a verdict (wall-clock or CPU limit, a crash,
    ``os._exit``, a broken or forged protocol message, a comparison over its time
    budget) gives ``[-1] * len(inputs)`` and metadata None, as NeMo Gym's global
    timeout does. ``JailError`` (no sandbox could be set up) propagates: that is
    not the model's fault and must not become a reward.
    """
    n = len(tests.inputs)
    call_based = tests.fn_name is not None
    comparer = comparer or Comparer(1)
    job: dict[str, Any] = {
        "mode": "call" if call_based else "stdio",
        "code": code,
        "timeout": timeout,
        "output_cap": output_cap,
        "fn_name": tests.fn_name,
        "inputs": list(tests.inputs),
    }
    budget = timeout + grace(timeout)
    try:
        async with runner.session(HARNESS, limits) as s:
            await s.send(job)
            await _expect(s, _Loading)
            try:
                first, _ = await _expect(s, _Ready, _Unprepared, budget=budget)
            except _OutOfTime:
                return _during_testing(Exception(""))  # a load the timer ended says just this
            if isinstance(first, _Unprepared):
                return [-4], {"error_code": -4, "error_message": f"Error during testing: {first.error}"}
            if call_based:
                try:  # after the program loaded, as NeMo Gym parses them
                    expected = [json.loads(out) for out in tests.outputs]
                except Exception as e:
                    return _during_testing(e)
                return await _run_calls(s, tests, expected, budget, output_cap, comparer)
            return await _run_stdio(s, tests, budget, output_cap, comparer)
    except (JailTimeout, JailExited, DecodeError, _Undecodable, TimeoutError):
        return [-1] * n, None


def _shorten_bytes(body: bytes) -> str:
    """``shorten`` of a UTF-8 text, from its first and last bytes only (no decoding of megabytes in the loop)."""
    if len(body) <= 2400:
        return shorten(body.decode("utf-8", "replace"))
    head = body[:600].decode("utf-8", "ignore")[:150]
    tail = body[-600:].decode("utf-8", "ignore")[-150:]
    return head + "...(truncated) ..." + tail


def _over_the_cap(gt_inp: Any, gt_out: Any, output_cap: int, what: str) -> dict[str, Any]:
    return {
        "output": "",
        "inputs": shorten(gt_inp),
        "expected": shorten(gt_out),
        "error_code": -2,
        "error_message": f"Wrong answer: {what} over the limit of {output_cap} bytes",
    }


async def _run_stdio(
    s: JailSession, tests: UnitTests, budget: float, output_cap: int, compare: Comparer
) -> tuple[list[int | bool], dict[str, Any] | None]:
    results: list[int | bool] = []
    for gt_inp, gt_out in zip(tests.inputs, tests.outputs):
        try:
            msg, body = await _expect(s, _Output, _Error, budget=budget, max_body=output_cap)
        except _OutOfTime:
            results.append(-3)
            return results, _error_meta(_TIMED_OUT, gt_inp, gt_out)
        except JailBodyTooLarge:  # counted here, in bytes, whatever the program told its harness
            results.append(-2)
            return results, _over_the_cap(gt_inp, gt_out, output_cap, "output")
        if isinstance(msg, _Error):
            results.append(msg.code)
            return results, _error_meta(msg, gt_inp, gt_out)
        assert body is not None
        if msg.overflow:
            results.append(-2)
            await s.send({"next": False})
            meta = _over_the_cap(gt_inp, gt_out, output_cap, "output")
            meta["output"] = _shorten_bytes(body)
            return results, meta
        try:
            wrong = await compare(len(body) + len(gt_out), stdio_judgement, body, gt_inp, gt_out)
        except (_Undecodable, TimeoutError):
            raise
        except Exception as e:
            return _during_testing(e)
        if wrong is not None:
            results.append(-2)
            await s.send({"next": False})
            return results, wrong
        results.append(True)
        await s.send({"next": True})
    done, _ = await _expect(s, _Done)
    return results, {"execution time": done.execution_time}


async def _run_calls(
    s: JailSession, tests: UnitTests, expected: list[Any], budget: float, output_cap: int, compare: Comparer
) -> tuple[list[int | bool], dict[str, Any] | None]:
    results: list[int | bool] = []
    for inp, gt_out, gt_text in zip(tests.inputs, expected, tests.outputs):
        gt_inp = _call_args(inp)
        try:
            msg, body = await _expect(s, _Output, _Error, budget=budget, max_body=output_cap)
        except _OutOfTime:
            results.append(-3)
            return results, _error_meta(_TIMED_OUT, gt_inp, gt_out)
        except JailBodyTooLarge as e:
            results.append(False)
            meta = _over_the_cap(gt_inp, gt_out, output_cap, "result")
            text = e.header.get("text") if isinstance(e.header, dict) else None
            meta["output"] = text if isinstance(text, str) else ""
            return results, meta
        if isinstance(msg, _Error):
            results.append(msg.code)
            return results, _error_meta(msg, gt_inp, gt_out)
        assert body is not None
        try:
            ok = await compare(len(body), judge_call, body, gt_text)
        except (DecodeError, TimeoutError):
            raise
        except Exception as e:  # e.g. RecursionError comparing: a runtime error, as under NeMo Gym
            results.append(-4)
            return results, _error_meta(_Error(code=-4, error=repr(e)), gt_inp, gt_out)
        if ok:
            results.append(True)
            await s.send({"next": True})
            continue
        await s.send({"next": False})
        results.append(False)  # NeMo Gym's entry for a wrong call (its metadata says -2)
        if msg.text is None:  # str() of the wrong answer raised: NeMo Gym then adds a -4
            err = msg.text_error or ["", ""]
            results.append(-4)
            return results, _error_meta(_Error(code=-4, error=err[0], traceback=err[1]), gt_inp, gt_out)
        return results, {
            "output": msg.text,
            "inputs": shorten(gt_inp),
            "expected": shorten(gt_out),
            "error_code": -2,
            "error_message": "Wrong Answer",
        }
    done, _ = await _expect(s, _Done)
    return results, {"execution time": done.execution_time}


def _call_args(inp: str) -> Any:
    """One call's arguments as the metadata shows them (the sandbox parsed the same lines)."""
    try:
        return [json.loads(line) for line in inp.split("\n")]
    except ValueError:
        return inp


__all__ = [
    "HARNESS",
    "Comparer",
    "JailError",
    "UnitTests",
    "compare_stdout",
    "extract_code",
    "global_timeout",
    "reasoning_format_violation",
    "run_unit_tests",
    "unit_tests",
]
