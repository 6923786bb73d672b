"""Issue 75 point 9: the TRL adapters' arguments checked when they are built, each mistake one line naming its fix
(before: ``failures={"retries": 1}`` was taken and raised ``AttributeError`` inside the first step, ``on_failure=``
was a bare ``TypeError``, a misspelt ``FailurePolicy`` field had no suggestion). Needs no TRL: the adapters are
built against a real client (embedded NATS, the weather workers in process); nothing is trained."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from gym_runtime import SyncClient
from gym_runtime.errors import ClientError
from gym_runtime.trainers.failures import FailurePolicy
from gym_runtime.trainers.trl import TRLRollouts
from gym_runtime.trainers.trl_async import GymRolloutWorker
from tests.helpers import ROWS, WEATHER


@pytest.fixture(scope="module")
def client() -> Iterator[SyncClient]:
    with SyncClient(str(WEATHER)) as c:
        yield c


def worker(client: SyncClient, **kw: Any) -> GymRolloutWorker:
    args: dict[str, Any] = {"sample": object, "num_generations": 2, "max_staleness": 1, "batch_size": 4}
    return GymRolloutWorker(client, ROWS, **(args | kw))


def said(excinfo: pytest.ExceptionInfo[ClientError]) -> str:
    text = str(excinfo.value)
    assert "\n" not in text, text
    return text


@pytest.mark.parametrize("build", ["sync", "async"])
def test_failures_as_a_dict_names_the_failure_policy_to_write(client: SyncClient, build: str) -> None:
    with pytest.raises(ClientError) as e:
        if build == "sync":
            TRLRollouts(client, ROWS, live=None, failures={"retries": 1})  # type: ignore[arg-type]
        else:
            worker(client, failures={"retries": 1})
    assert said(e) == (
        "failures={'retries': 1}: give FailurePolicy(retries=1), not a dict "
        "(from gym_runtime.trainers.failures import FailurePolicy)"
    )


@pytest.mark.parametrize("build", ["sync", "async"])
def test_an_old_argument_names_what_replaced_it(client: SyncClient, build: str) -> None:
    with pytest.raises(ClientError) as e:
        if build == "sync":
            TRLRollouts(client, ROWS, live=None, on_failure="drop")  # type: ignore[call-arg]
        else:
            worker(client, on_failure="drop")
    text = said(e)
    who = "TRLRollouts" if build == "sync" else "GymRolloutWorker"
    assert text.startswith(f"{who}() takes no argument 'on_failure': give failures=FailurePolicy(...)"), text


def test_a_misspelt_argument_gets_the_nearest_one(client: SyncClient) -> None:
    with pytest.raises(ClientError) as e:
        worker(client, num_generation=2)
    assert "GymRolloutWorker() takes no argument 'num_generation'; did you mean 'num_generations'?" in said(e)
    with pytest.raises(ClientError) as e:
        TRLRollouts(client, ROWS, live=None, max_stalenes=1)  # type: ignore[call-arg]
    assert "did you mean 'max_staleness'?" in said(e)


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"num_generations": 0}, "num_generations=0: give a whole number >= 1"),
        ({"num_generations": "4"}, "num_generations='4': give a whole number >= 1"),
        ({"batch_size": 0}, "batch_size=0: give a whole number >= 1"),
        ({"max_staleness": -1}, "max_staleness=-1: give a whole number >= 0"),
        ({"token_budget": 0}, "token_budget=0: give a whole number >= 1"),
    ],
)
def test_a_worker_size_that_cannot_be_is_one_line(client: SyncClient, kw: dict[str, Any], words: str) -> None:
    with pytest.raises(ClientError) as e:
        worker(client, **kw)
    assert said(e) == words


def test_a_misspelt_failure_policy_field_gets_a_did_you_mean() -> None:
    with pytest.raises(ClientError) as e:
        FailurePolicy(retry=1)  # type: ignore[call-arg]
    assert said(e) == (
        "FailurePolicy has no field 'retry'; did you mean 'retries'? its fields are policy_failure_reward, retries, "
        "max_excluded, refill"
    )
    with pytest.raises(ClientError) as e:
        FailurePolicy(retries="1")  # type: ignore[arg-type]
    assert said(e) == "FailurePolicy: retries is a whole number, got '1'"
    with pytest.raises(ClientError) as e:
        FailurePolicy(1)  # type: ignore[call-arg]
    assert "takes its fields by name, e.g. FailurePolicy(retries=1)" in said(e)


def test_good_arguments_build(client: SyncClient) -> None:
    policy = FailurePolicy(retries=1, max_excluded=0.5)
    assert TRLRollouts(client, ROWS, live=None, failures=policy).failures is policy
    w = worker(client, failures=policy, token_budget=256)
    assert w.failures is policy and w.num_generations == 2
