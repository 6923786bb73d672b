"""This repository's differential tests against NeMo Gym: its recorded data in ``tests/compat`` (with its
notice), found here, and each bundled environment's cases checked against NeMo Gym's rewards and fields.

The generic steps (join rollouts to tasks, replay, re-verify) are ``gym_runtime.testing``'s, for any author;
what reaches into this repository's ``tests/compat`` lives here, beside the tests, not in the installed package.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from gym_runtime import testing
from gym_runtime.resource import Resource
from gym_runtime.testing import *  # noqa: F403 (the authors' helpers, which the environments' tests use beside these)
from gym_runtime.testing import joined_rollouts, read_jsonl, recorded_response, verify_once

own = ["CASE_KEYS", "COMPAT", "compat_dir", "differential_cases", "example_rollouts", "reverify_differential"]
__all__ = [*own, *testing.__all__]  # one import in an environment's tests

# What a differential case adds to its task row: NeMo Gym's reward and fields for it.
CASE_KEYS = ("expected_reward", "expected_fields", "case")
REPO = Path(__file__).resolve().parents[1]  # the repository's root
# The compat data lives in the repository (tests/compat, with its notice); GYM_COMPAT_DIR points elsewhere.
COMPAT = Path(os.environ.get("GYM_COMPAT_DIR") or REPO / "tests" / "compat")


def compat_dir(*parts: str | Path) -> Path:
    """``tests/compat/<parts>`` (a file or a folder). Missing data is an error, never a skip:
    the data ships with the repo."""
    path = COMPAT.joinpath(*parts)
    if not path.exists():
        raise FileNotFoundError(f"compat data not found at {path} (it ships in tests/compat)")
    return path


def example_rollouts(env_dir: Path, recorded: Path) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(task row, rollout row) pairs: an environment's ``data/example.jsonl`` joined with
    NeMo Gym's ``example_rollouts.jsonl`` in the compat folder ``recorded``."""
    return joined_rollouts(env_dir / "data" / "example.jsonl", compat_dir(recorded / "example_rollouts.jsonl"))


def differential_cases(env: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(task row, case) for each of ``tests/compat/differential/<env>.jsonl``: the row is the
    case without NeMo Gym's expectations (``CASE_KEYS``), which stay on the case."""
    cases = read_jsonl(compat_dir("differential", f"{env}.jsonl"))
    return [({k: v for k, v in c.items() if k not in CASE_KEYS}, c) for c in cases]


async def reverify_differential(cls: type[Resource], env: str, *, at_least: int, tolerance: float = 0.0) -> None:
    """Verify each of ``differential_cases(env)`` (at least ``at_least`` of them) in a fresh session: its
    reward (within ``tolerance``) and its extra fields must be NeMo Gym's."""
    cases = differential_cases(env)
    assert len(cases) >= at_least, f"{len(cases)} differential cases for {env}"
    for row, case in cases:
        v = await verify_once(cls, row, recorded_response(row.pop("response")))
        assert abs(v.reward - case["expected_reward"]) <= tolerance, case["case"]
        assert v.fields == case["expected_fields"], case["case"]
