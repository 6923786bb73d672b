"""code_gen: run the model's Python program against the task's unit tests, in a real sandbox.

Matches NeMo Gym's ``code_gen`` resources server (LiveCodeBench grading). Task rows
carry ``verifier_metadata.unit_tests = {inputs, outputs, fn_name}`` (optionally
compressed as ``{"packed": base64(zlib(json))}``) and optionally
``verifier_metadata.difficulty``. ``verify``:

1. takes the response text (every ``output_text`` part of every output message);
   empty or blank text gives reward 0 with no other field set;
2. extracts the program: the lines between the *last two* lines that contain
   a code fence (any language tag); no such pair gives reward 0 with only
   ``extracted_model_output`` set;
3. runs the program in the sandbox (``gym_runtime.jail``, ``harness.py``): stdin/stdout
   tests when ``fn_name`` is null (output compared line by line, tokens as
   ``Decimal``), else calls of ``Solution().<fn_name>`` (or a module function);
   it stops at the first failing test;
4. reward is 1.0 when every entry of ``result`` is ``True``, else 0.0; but a
   ``<think>`` format violation (a ``<think>``/``</think>`` tag in the answer
   text, or either tag more than once in the reasoning summaries) gives
   ``reasoning_format_penalty`` instead (default 0.0).

Extra fields (NeMo Gym's names): ``extracted_model_output``, ``extracted_model_code``,
``result`` (one entry per test run: ``True``, or the failing test's code: -1 the run
ended without a verdict (whole-run time limit, crash), -2 wrong answer, -3 time
limit, -4 runtime error or the program could not be prepared), ``metadata``
(details of the failure, or ``{"execution time": s}``), ``unit_tests_time_taken``,
``reasoning_format_violation_rate`` (1.0 or 0.0), ``difficulty``.

Options (``resources.<name>.options`` in the config; every key optional):
``unit_test_timeout_secs`` (10, per test), ``max_parallel`` (sandboxes running
at once per worker, default the CPU count), ``reasoning_format_penalty`` (0.0),
``wall_time_s`` (whole run; default NeMo Gym's ``(timeout + 1) * tests + 5``),
``cpu_time_s`` (default = wall time), ``memory_mb`` (4096, the whole sandbox),
``max_output_mb`` (16, captured stdout per test), ``max_file_mb`` (64, the
working directory), ``max_processes`` (64), ``use_cgroup`` (true: one cgroup per
sandbox where writable, limiting memory and processes of the sandbox as a whole;
false, or none writable: the program may not start processes, only threads),
``python`` (the interpreter that runs programs; default this one).
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from typing import Any

import msgspec

from gym_runtime.errors import Failure
from gym_runtime.jail import JailRunner, Limits, probe
from gym_runtime.messages import Response, output_text
from gym_runtime.resource import Resource, Verdict, parse_options

from .grading import (
    MAX_UNPACKED_MB,
    Comparer,
    UnitTests,
    extract_code,
    global_timeout,
    reasoning_format_violation,
    run_unit_tests,
    unit_tests,
)

__all__ = ["CodeGen", "CodeGenOptions"]


class CodeGenOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    unit_test_timeout_secs: float = 10
    max_parallel: int = msgspec.field(default_factory=lambda: os.cpu_count() or 1)
    reasoning_format_penalty: float = 0.0
    wall_time_s: float | None = None
    cpu_time_s: float | None = None
    memory_mb: int = 4096
    max_output_mb: float = 16
    max_file_mb: int = 64
    max_unit_tests_mb: float = MAX_UNPACKED_MB  # a packed unit_tests unpacking to more is an invalid_task
    max_processes: int = 64
    use_cgroup: bool = True
    python: str | None = None

    def __post_init__(self) -> None:
        if self.unit_test_timeout_secs <= 0:
            raise ValueError("unit_test_timeout_secs must be > 0")
        if self.max_parallel < 1:
            raise ValueError("max_parallel must be >= 1")
        if self.max_unit_tests_mb <= 0:
            raise ValueError("max_unit_tests_mb must be > 0")


def _options(raw: dict[str, Any]) -> CodeGenOptions:
    return parse_options(raw, CodeGenOptions, "code_gen")


class CodeGenTask(msgspec.Struct, kw_only=True):
    """The task fields verify reads: ``verifier_metadata.unit_tests``."""

    verifier_metadata: dict[str, Any]


class CodeGen(Resource):
    """Stateless: every instance grades the same way; sandboxes are shared per worker."""

    task_fields = CodeGenTask

    @staticmethod
    def check_task(task: dict[str, Any], /) -> UnitTests:
        """The row's tests (a publisher has not run ``setup``: the default ``max_unit_tests_mb`` applies)."""
        return unit_tests(task, max_mb=CodeGen._opts.max_unit_tests_mb)

    _opts: CodeGenOptions = CodeGenOptions()
    _runner: JailRunner | None = None
    _comparer: Comparer | None = None
    _runner_loop: Any = None

    @classmethod
    async def setup(cls, options: dict[str, Any]) -> None:
        opts = _options(options)  # validate first: a bad config changes nothing
        await super().setup(options)
        cls._opts = opts
        cls._runner = None
        cls._get_runner()

    @classmethod
    def _get_runner(cls) -> JailRunner:
        """The worker's sandbox runner (one per event loop: its semaphore belongs to that loop)."""
        loop = asyncio.get_running_loop()
        if cls._runner is None or cls._runner_loop is not loop:
            cls._runner = JailRunner(cls._opts.max_parallel, python=cls._opts.python)
            cls._comparer = Comparer(max(1, min(cls._opts.max_parallel, (os.cpu_count() or 2) // 2)))
            cls._runner_loop = loop
        return cls._runner

    @classmethod
    def _get_comparer(cls) -> Comparer:
        cls._get_runner()
        assert cls._comparer is not None
        return cls._comparer

    @classmethod
    def sandbox_info(cls) -> dict[str, Any]:
        return probe()

    @classmethod
    def limits_for(cls, n_tests: int) -> Limits:
        o = cls._opts
        wall = o.wall_time_s if o.wall_time_s is not None else global_timeout(o.unit_test_timeout_secs, n_tests)
        return Limits(
            wall_s=wall,
            cpu_s=o.cpu_time_s if o.cpu_time_s is not None else wall,
            memory_bytes=o.memory_mb << 20,
            file_bytes=o.max_file_mb << 20,
            nproc=o.max_processes,
            cgroup=o.use_cgroup,
        )

    async def verify(self, task: dict[str, Any], response: Response) -> Verdict:
        o = self._opts
        text = output_text(response.output)
        meta = task.get("verifier_metadata")
        fields: dict[str, Any] = {
            "extracted_model_output": None,
            "extracted_model_code": None,
            "result": None,
            "metadata": None,
            "unit_tests_time_taken": None,
            "reasoning_format_violation_rate": 0.0,
            "difficulty": meta.get("difficulty") if isinstance(meta, dict) else None,
        }
        if not text or not text.strip():
            return Verdict(reward=0.0, fields=fields)
        try:
            tests = unit_tests(task, max_mb=o.max_unit_tests_mb)
        except ValueError as e:  # the row, not the program: no attempt can help
            raise Failure("invalid_task", str(e)) from None
        code = extract_code(text)
        fields["extracted_model_output"] = text
        if not code:
            return Verdict(reward=0.0, fields=fields)

        started = time.monotonic()
        result, metadata = await run_unit_tests(
            self._get_runner(),
            code,
            tests,
            timeout=o.unit_test_timeout_secs,
            limits=self.limits_for(len(tests.inputs)),
            output_cap=int(o.max_output_mb * (1 << 20)),
            comparer=self._get_comparer(),
        )
        took = time.monotonic() - started
        violation = reasoning_format_violation(response, text)
        if violation:
            reward = o.reasoning_format_penalty
        else:
            reward = 1.0 if all(r == True for r in result) else 0.0  # noqa: E712 (NeMo Gym's test)
        fields.update(
            extracted_model_code=code,
            result=result,
            metadata=metadata,
            unit_tests_time_taken=took if math.isfinite(took) else None,
            reasoning_format_violation_rate=1.0 if violation else 0.0,
        )
        return Verdict(reward=float(reward), fields=fields)
