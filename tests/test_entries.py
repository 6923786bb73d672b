"""Two entries of one environment in one process each keep their own options.

``Resource.setup(cls, options)`` keeps what it parses on the class it is called on; every config
entry's workers get a class of their own (``resource.entry_class``), so the second entry of an
environment never serves the first's rows with its own settings (the docs' OpenEnv example, one
environment in process and one by URL, has this shape). Real workers on a real server.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from gym_runtime.config import ResourceConfig
from gym_runtime.messages import SeedReply, SeedRequest, VerifyReply, VerifyRequest
from gym_runtime.testing import text_response
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.subjects import Subjects
from gym_runtime.workers.resource_worker import ResourceWorker
from tests.helpers import resolved

# every bundled environment kind whose setup reads options: (entry a's, entry b's)
TWO_ENTRIES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "mcqa": ({"grading_mode": "strict_single_letter_boxed"}, {"grading_mode": "lenient_answer_colon"}),
    "code_gen": ({"unit_test_timeout_secs": 10, "max_parallel": 2}, {"unit_test_timeout_secs": 11, "max_parallel": 3}),
    "math": ({"should_use_judge": False}, {"should_use_judge": True}),
    "equivalence_llm_judge": ({"judge_prompt_template": "A {question}"}, {"judge_prompt_template": "B {question}"}),
    "google_search": ({"backend": "offline", "top_k": 5}, {"backend": "offline", "top_k": 6}),
    "swe": ({"backend": "local", "command_timeout_s": 60}, {"backend": "local", "command_timeout_s": 61}),
    "openenv": ({"env": "tests.envs.openenv_counter:CountEnv"}, {"env": "tests.envs.openenv_mcp:TallyEnv"}),
    "openreward": ({"env": "tests.envs.ors_quiz:Quiz"}, {"env": "tests.envs.ors_repair:Repair"}),
}


@contextlib.asynccontextmanager
async def two_entries(bus: Bus, server: str) -> AsyncIterator[tuple[ResourceWorker, ResourceWorker]]:
    a, b = TWO_ENTRIES[server]
    # in this process (isolation: none, also for OpenEnv): two entries' setups share one process here; in guest
    # processes (OpenEnv's default) each entry's setup runs in a process of its own

    def worker(name: str, options: dict[str, Any]) -> ResourceWorker:
        entry = ResourceConfig(server=f"resources.{server}", options=options, isolation="none")
        return ResourceWorker(bus, name, resolved(resources={name: entry}))

    workers = (worker(f"{server}_a", a), worker(f"{server}_b", b))
    async with anyio.create_task_group() as tg:
        for w in workers:  # both set up before either serves: the second setup used to overwrite the first
            await tg.start(w.run)
        yield workers
        tg.cancel_scope.cancel()


@pytest.mark.parametrize("server", sorted(TWO_ENTRIES))
async def test_each_entry_of_an_environment_keeps_its_own_options(bus: Bus, server: str) -> None:
    async with two_entries(bus, server) as (wa, wb):
        assert wa.cls is not wb.cls and issubclass(wa.cls, wb.cls.__mro__[1])
        assert wa.cls.options == TWO_ENTRIES[server][0] and wb.cls.options == TWO_ENTRIES[server][1]


async def _verify(bus: Bus, entry: str, row: dict[str, Any], answer: str) -> float:
    seeded = await bus.request(bus.subjects.seed(entry, bus.caller), SeedRequest(row=row), timeout=30, op="seed")
    assert isinstance(seeded, SeedReply)
    response = text_response(answer)
    reply = await bus.request(
        Subjects.session_call(seeded.address, "verify", bus.caller),
        VerifyRequest(session=seeded.session, row=row, response=response, close=True),
        timeout=30,
        op="verify",
    )
    assert isinstance(reply, VerifyReply)
    return reply.reward


async def test_two_mcqa_entries_grade_the_same_answer_each_by_its_own_mode(bus: Bus) -> None:
    row = {
        "responses_create_params": {"input": [{"role": "user", "content": "Pick one.\nA: red\nB: blue"}]},
        "options": [{"A": "red"}, {"B": "blue"}],
        "expected_answer": "B",
    }
    async with two_entries(bus, "mcqa"):
        # "Answer: B" without a box: the strict entry finds no letter, the answer-colon entry finds B
        assert await _verify(bus, "mcqa_a", row, "Answer: B") == 0.0
        assert await _verify(bus, "mcqa_b", row, "Answer: B") == 1.0
