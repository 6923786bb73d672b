"""SWE-bench-style grading: apply the model's patch and the task's test patch to a fresh checkout, run the tests.

The task is *resolved* (reward 1.0) iff every ``FAIL_TO_PASS`` test and every
``PASS_TO_PASS`` test passes afterwards. Tests run with pytest (``-rA``) and each
listed id's status is read from pytest's summary lines (``PASSED id``,
``FAILED id``, ``XFAIL id`` ...), as SWE-bench's log parser does for pytest
repositories; an id pytest did not report (not found, collection error) fails.
A patch is applied with ``git apply``, falling back to ``patch --fuzz=5`` like
SWE-bench; a model patch that does not apply scores 0 (``patch_applied: false``).
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

from .environments import APPLY, DIFF, PATCH_FILE, Backend, Environment

__all__ = ["APPLY", "DIFF", "PATCH_FILE", "Report", "grade", "parse_pytest", "parse_unittest", "test_ids"]

PASSING = ("PASSED", "XFAIL")
_STATUS = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\s+(\S.*?)(?:\s+-\s+.*)?$")


def test_ids(task: dict[str, Any], key: str) -> list[str]:
    """A row's test list (a JSON list, or a JSON string of one as in SWE-bench's HF rows)."""
    value = task.get(key) or []
    if isinstance(value, str):
        value = json.loads(value) if value.strip().startswith("[") else [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{key} must be a list of test ids")
    return value


def parse_pytest(output: str) -> dict[str, str]:
    """{test id: status} from pytest's ``-rA`` short summary."""
    found: dict[str, str] = {}
    for line in output.splitlines():
        m = _STATUS.match(line.strip())
        if m:
            found[m.group(2).strip()] = m.group(1)
    return found


# ``python -m unittest -v``: "test_add (test_calc.TestCalc.test_add) ... ok" (3.11+; before: "(test_calc.TestCalc)")
_UNITTEST = re.compile(
    r"^(\w+) \(([\w.]+)\)(?:\n[^\n]*)? \.\.\. (ok|FAIL|ERROR|skipped.*|expected failure|unexpected success)$", re.M
)
_UNITTEST_STATUS = {"ok": "PASSED", "FAIL": "FAILED", "ERROR": "ERROR", "expected failure": "XFAIL"}


def parse_unittest(output: str) -> dict[str, str]:
    """{dotted test id: status} from ``python -m unittest -v`` (SWE-bench's parser for such repositories
    reads the same lines); a test with a docstring prints it on the next line, which is allowed for."""
    found: dict[str, str] = {}
    for m in _UNITTEST.finditer(output):
        name, where, word = m.groups()
        tid = where if where.endswith("." + name) else f"{where}.{name}"
        found[tid] = _UNITTEST_STATUS.get(word, "SKIPPED" if word.startswith("skipped") else "XPASS")
    return found


PARSERS = {"pytest": parse_pytest, "unittest": parse_unittest}


@dataclass
class Report:
    resolved: bool = False
    patch_applied: bool = False
    tests_status: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    timed_out: bool = False
    error: str | None = None

    def fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "resolved": self.resolved,
            "patch_applied": self.patch_applied,
            "tests_status": self.tests_status,
            "eval_timed_out": self.timed_out,
        }
        if self.error:
            out["eval_error"] = self.error
        return out


async def apply_patch(env: Environment, patch: str, timeout_s: float) -> tuple[bool, str]:
    if not patch.strip():
        return True, ""
    await env.write(PATCH_FILE, patch if patch.endswith("\n") else patch + "\n")
    res = await env.run(env.apply_command, timeout_s)
    return res.returncode == 0, res.output


async def grade(
    backend: Backend,
    task: dict[str, Any],
    model_patch: str,
    *,
    timeout_s: float,
    test_command: str,
    log_parser: str = "pytest",
) -> Report:
    """Grade ``model_patch`` for ``task`` in a fresh environment (always closed afterwards)."""
    f2p, p2p = test_ids(task, "FAIL_TO_PASS"), test_ids(task, "PASS_TO_PASS")
    report = Report()
    env = await backend.start(task)
    try:
        report.patch_applied, out = await apply_patch(env, model_patch, timeout_s)
        if not report.patch_applied:
            report.error = "the model's patch does not apply: " + out[-500:]
            return report
        ok, out = await apply_patch(env, str(task.get("test_patch") or ""), timeout_s)
        if not ok:
            report.error = "the task's test patch does not apply: " + out[-500:]
            return report
        ids = f2p + [t for t in p2p if t not in f2p]
        res = await env.run(test_command.format(tests=" ".join(shlex.quote(t) for t in ids)), timeout_s)
        report.timed_out = res.timed_out
        status = PARSERS[log_parser](res.output)
        for key, tests in (("FAIL_TO_PASS", f2p), ("PASS_TO_PASS", p2p)):
            ok_ids = [t for t in tests if status.get(t) in PASSING]
            report.tests_status[key] = {"success": ok_ids, "failure": [t for t in tests if t not in ok_ids]}
        report.resolved = (
            not res.timed_out and all(not v["failure"] for v in report.tests_status.values()) and bool(ids)
        )
        return report
    finally:
        await env.close()
