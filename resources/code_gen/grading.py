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
import json
import os
import zlib
from decimal import Decimal
from typing import Any, Literal

import msgspec

from gym_runtime.messages import Reasoning, Response
from gym_runtime.resource import run_in_process
from gym_runtime.sandbox import Limits, SandboxError, SandboxExited, SandboxRunner, SandboxSession, SandboxTimeout

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


def unit_tests(task: dict[str, Any]) -> UnitTests:
    """The task's ``verifier_metadata.unit_tests``, also in the compressed ``{"packed": ...}`` form."""
    meta = task.get("verifier_metadata")
    if not isinstance(meta, dict) or "unit_tests" not in meta:
        raise ValueError("task row: verifier_metadata.unit_tests is missing")
    raw = meta["unit_tests"]
    if isinstance(raw, dict) and "packed" in raw:
        decoded = json.loads(zlib.decompress(base64.b64decode(raw["packed"])))
        raw = {"inputs": decoded["inputs"], "outputs": decoded["outputs"], "fn_name": raw.get("fn_name")}
    try:
        return msgspec.convert(raw, UnitTests)
    except msgspec.ValidationError as e:
        raise ValueError(f"task row: verifier_metadata.unit_tests: {e}") from None


def shorten(value: Any, length: int = 300) -> str:
    text = value if isinstance(value, str) else str(value)
    if len(text) <= length:
        return text
    return text[: length // 2] + "...(truncated) ..." + text[-length // 2 :]


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.strip().split("\n")]


def _decimals(line: str) -> list[Decimal] | None:
    try:
        return [Decimal(tok) for tok in line.split()]
    except Exception:
        return None


def compare_stdout(prediction: str, gt_inp: str, gt_out: str) -> dict[str, Any] | None:
    """None when the output is accepted, else NeMo Gym's wrong-answer metadata.

    Both texts are stripped and split into lines, each line stripped; the line
    counts must agree; each line must be equal as text or, token by token, as
    ``Decimal`` numbers (so ``3.0`` equals ``3``, ``1e3`` equals ``1000``; no
    tolerance). May raise (e.g. ``decimal.InvalidOperation`` comparing an sNaN),
    which, as under NeMo Gym, fails the whole run with ``Error during testing``.
    """
    got, want = _lines(prediction), _lines(gt_out)
    meta: dict[str, Any] = {
        "output": shorten(prediction),
        "inputs": shorten(gt_inp),
        "expected": shorten(gt_out),
        "error_code": -2,
    }
    if len(got) != len(want):
        meta["error_message"] = "Wrong answer: mismatched output length"
        return meta
    for idx, (g, w) in enumerate(zip(got, want)):
        if g == w:
            continue
        meta["error_message"] = f"Wrong answer at output_line_idx={idx}: {shorten(g)} != {shorten(w)}"
        dg = _decimals(g)
        if dg is None:
            return meta
        dw = _decimals(w)
        if dw is None:
            return meta
        if dg == dw:
            continue
        return meta
    return None


# ----------------------------------------------------------------------------- one run


def global_timeout(timeout: float, n_tests: int) -> float:
    """NeMo Gym's whole-run limit: ``(timeout + 1) * len(inputs) + 5`` seconds."""
    return (timeout + 1) * n_tests + 5


class _Ready(msgspec.Struct, tag_field="kind", tag="ready", forbid_unknown_fields=True):
    pass


class _Unprepared(msgspec.Struct, tag_field="kind", tag="unprepared", forbid_unknown_fields=True):
    error: str


class _Output(msgspec.Struct, tag_field="kind", tag="output", forbid_unknown_fields=True):
    """One test's raw output: captured stdout, or a call's result as data (``harness.encode``)."""

    output: str | None = None
    overflow: bool = False
    value: Any = None
    text: str | None = None
    text_error: list[str] | None = None


class _Error(msgspec.Struct, tag_field="kind", tag="error", forbid_unknown_fields=True):
    code: Literal[-3, -4]
    error: str
    traceback: str | None = None


class _Done(msgspec.Struct, tag_field="kind", tag="done", forbid_unknown_fields=True):
    execution_time: float


_Message = _Ready | _Unprepared | _Output | _Error | _Done


async def _expect(s: SandboxSession, *kinds: type) -> Any:
    """The next message, which must be one of ``kinds``; anything else ends the run without a verdict."""
    raw = await s.recv()
    try:
        msg = msgspec.convert(raw, _Message)
    except msgspec.ValidationError:
        raise SandboxExited("malformed message", None, "") from None
    if not isinstance(msg, kinds):
        raise SandboxExited(f"unexpected {type(msg).__name__[1:].lower()} message", None, "")
    return msg


# Comparisons bigger than this run in a worker process (Decimal-parsing megabytes of
# output would stall the event loop); smaller ones are faster inline.
INLINE_COMPARE_CHARS = 1 << 20


async def _off_loop(size: int, fn: Any, *args: Any) -> Any:
    if size <= INLINE_COMPARE_CHARS:
        return fn(*args)
    return await run_in_process(fn, *args)


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


def _during_testing(e: BaseException) -> tuple[list[int | bool], dict[str, Any]]:
    return [-4], {"error_code": -4, "error_message": f"Error during testing: {e}"}


async def run_unit_tests(
    runner: SandboxRunner,
    code: str,
    tests: UnitTests,
    *,
    timeout: float,
    limits: Limits,
    output_cap: int,
) -> tuple[list[int | bool], dict[str, Any] | None]:
    """Run ``code`` against ``tests`` in one sandboxed process; NeMo Gym's ``(result, metadata)``.

    The sandbox only ever sees the inputs and only ever sends raw outputs: every
    verdict is decided here, test by test (the sandbox waits for "go on" after
    each, so tests stop at the first failure as under NeMo Gym). A run that ends
    without a verdict (wall-clock or CPU limit, a crash, ``os._exit``, a broken
    or forged protocol message) gives ``[-1] * len(inputs)`` and metadata None,
    as NeMo Gym's global timeout does. ``SandboxError`` (no sandbox could be set
    up) propagates: that is not the model's fault and must not become a reward.
    """
    n = len(tests.inputs)
    call_based = tests.fn_name is not None
    job: dict[str, Any] = {
        "mode": "call" if call_based else "stdio",
        "code": code,
        "timeout": timeout,
        "output_cap": output_cap,
        "fn_name": tests.fn_name,
        "inputs": list(tests.inputs),
    }
    try:
        async with runner.session(HARNESS, limits) as s:
            await s.send(job)
            first = await _expect(s, _Ready, _Unprepared)
            if isinstance(first, _Unprepared):
                return [-4], {"error_code": -4, "error_message": f"Error during testing: {first.error}"}
            if call_based:
                try:  # after the program loaded, as NeMo Gym parses them
                    expected = [json.loads(out) for out in tests.outputs]
                except Exception as e:
                    return _during_testing(e)
                return await _run_calls(s, tests, expected)
            return await _run_stdio(s, tests, output_cap)
    except (SandboxTimeout, SandboxExited):
        return [-1] * n, None


async def _run_stdio(
    s: SandboxSession, tests: UnitTests, output_cap: int
) -> tuple[list[int | bool], dict[str, Any] | None]:
    results: list[int | bool] = []
    for gt_inp, gt_out in zip(tests.inputs, tests.outputs):
        msg = await _expect(s, _Output, _Error)
        if isinstance(msg, _Error):
            results.append(msg.code)
            return results, _error_meta(msg, gt_inp, gt_out)
        prediction = msg.output
        if not isinstance(prediction, str):
            raise SandboxExited("output without text", None, "")
        if msg.overflow:
            results.append(-2)
            await s.send({"next": False})
            return results, {
                "output": shorten(prediction),
                "inputs": shorten(gt_inp),
                "expected": shorten(gt_out),
                "error_code": -2,
                "error_message": f"Wrong answer: output over the limit of {output_cap} characters",
            }
        try:
            wrong = await _off_loop(len(prediction) + len(gt_out), compare_stdout, prediction, gt_inp, gt_out)
        except Exception as e:
            return _during_testing(e)
        if wrong is not None:
            results.append(-2)
            await s.send({"next": False})
            return results, wrong
        results.append(True)
        await s.send({"next": True})
    done = await _expect(s, _Done)
    return results, {"execution time": done.execution_time}


async def _run_calls(
    s: SandboxSession, tests: UnitTests, expected: list[Any]
) -> tuple[list[int | bool], dict[str, Any] | None]:
    results: list[int | bool] = []
    for inp, gt_out in zip(tests.inputs, expected):
        msg = await _expect(s, _Output, _Error)
        gt_inp = _call_args(inp)
        if isinstance(msg, _Error):
            results.append(msg.code)
            return results, _error_meta(msg, gt_inp, gt_out)
        try:
            ok = await _off_loop(len(json.dumps(msg.value)), judge_call, msg.value, gt_out)
        except DecodeError:
            raise SandboxExited("undecodable result", None, "") from None
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
    done = await _expect(s, _Done)
    return results, {"execution time": done.execution_time}


def _call_args(inp: str) -> Any:
    """One call's arguments as the metadata shows them (the sandbox parsed the same lines)."""
    try:
        return [json.loads(line) for line in inp.split("\n")]
    except ValueError:
        return inp


__all__ = [
    "HARNESS",
    "SandboxError",
    "UnitTests",
    "compare_stdout",
    "extract_code",
    "global_timeout",
    "reasoning_format_violation",
    "run_unit_tests",
    "unit_tests",
]
