"""One record per failure class (issue 74, item 4): every ``ErrorClass`` has one, and its readers (attribution,
NeMo Gym's ``EpisodeFailure``, what environment code may raise) and the docs' tables say what it says. Before, the
gateway's own map lacked ``sandbox_unavailable``: NeMo Gym was told that failure was terminal and of no kind."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest

from gym_runtime.data.attribution import attribute
from gym_runtime.data.error_classes import CLASSES, as_environments
from gym_runtime.errors import Failure, observed
from gym_runtime.gateway import episodes
from gym_runtime.messages import ErrorClass, SandboxReply
from gym_runtime.sandboxes.client import _Waiting

DOCS = Path(__file__).parents[2] / "docs"


def test_every_error_class_has_one_record_and_every_reader_reads_it() -> None:
    assert set(CLASSES) == set(typing.get_args(ErrorClass))
    for name, record in CLASSES.items():
        failure = episodes.failure_of(name, "why")
        assert (failure.failure_kind, failure.terminal, failure.stage) == (record.kind, record.terminal, record.stage)
        if record.attribution is not None:
            assert attribute(name) == record.attribution, name
    unavailable = episodes.failure_of("sandbox_unavailable", "no lease")
    assert unavailable.failure_kind == "provider_unavailable" and unavailable.terminal is False
    assert {n for n, r in CLASSES.items() if r.environment} == {"tool_error", "verify_error", "invalid_task"}
    assert all(CLASSES[n].attribution == "environment" for n in ("tool_error", "verify_error", "invalid_task"))


def test_docs_nemo_gym_table_gives_every_class_its_kind_terminal_and_stage() -> None:
    text = (DOCS / "nemo-gym.md").read_text()
    table = text.split("| gym-runtime error class | `failure_kind` | `terminal` | `stage` |", 1)[1].split("\n\n", 1)[0]
    documented: dict[str, tuple[str, bool, str | None]] = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        names = re.findall(r"^`(\w+)`|, `(\w+)`", cells[0])
        names = [a or b for a, b in names]
        kinds = re.findall(r"`([\w:]+)`", cells[1])
        if not names or not kinds:
            continue  # not a class of ours (the collector's own timeouts, PublishTimeout)
        kinds = kinds if len(kinds) == len(names) else kinds * len(names)
        stage = cells[3].strip("`") if cells[3] != "—" else None
        for name, kind in zip(names, kinds):
            assert name not in documented, name
            documented[name] = (kind, cells[2] == "yes", stage)
    documented.pop("publish_timeout", None)
    assert set(documented) == set(CLASSES)
    for name, said in documented.items():
        record = CLASSES[name]  # type: ignore[index]
        assert said == (record.kind, record.terminal, record.stage), name


def test_a_class_environment_code_chose_is_its_own_and_the_runtimes_finding_keeps_its_class() -> None:
    forged = as_environments(Failure("worker_lost", "gone (says the tool)", retryable=True), "tool_error", "tool 'x'")
    assert forged.info.error_class == "tool_error" and forged.info.retryable is True
    assert forged.info.message == "tool 'x' raised a worker_lost of its own: gone (says the tool)"
    seen = observed(Failure("worker_lost", "the model worker stopped answering"))
    assert as_environments(seen, "verify_error", "verify") is seen
    invalid = Failure("invalid_task", "cannot be graded")
    assert as_environments(invalid, "verify_error", "verify") is invalid


def test_a_sandbox_pool_with_no_lease_is_the_runtimes_finding_wherever_environment_code_passes_it_on() -> None:
    waiting = _Waiting("box")
    waiting.since -= 10.0  # no lease released for 10 s, past the pool's lease_wait_s
    with pytest.raises(Failure) as e:
        waiting.saw(SandboxReply(full=True, address="w1", released=0, lease_wait_s=1.0))
    assert e.value.info.error_class == "sandbox_unavailable" and e.value.observed
    assert as_environments(e.value, "tool_error", "tool 'x'") is e.value
