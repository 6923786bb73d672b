"""A test environment that scores a task's repeats together, as NeMo Gym's genrm_compare does.

``verify`` holds each rollout (process-local state, keyed by the row's ``_ng_task_index``) until
all ``cohort_size`` repeats of its task arrived, then answers each with the cohort it was scored
in; a rollout whose cohort is not complete within ``cohort_wait_s`` gets reward 0 and the members
it saw. So a row's ``cohort`` field shows whether the repeats reached it together.

A row with ``hold_file`` is not held in a cohort: while that file exists, its last repeat
(``_ng_rollout_index == hold_index``) writes ``hold_file + ".held"`` and blocks (a worker can be
killed mid-group); every row says whether the file existed when it was scored (``first_run``). The
repeat ``fail_index`` of a row's task raises in its verify (the group fails after its siblings were scored).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, ClassVar

from gym_runtime.messages import Response
from gym_runtime.resource import Resource, Verdict, tool


class _Cohort:
    def __init__(self) -> None:
        self.members: list[int] = []
        self.full = asyncio.Event()


class Cohort(Resource):
    # Shared by the sessions of this worker process, as genrm_compare's cohorts are per server process.
    cohorts: ClassVar[dict[Any, _Cohort]] = {}

    @tool
    async def get_weather(self, city: str) -> dict[str, str]:
        return {"city": city, "weather_description": "cold"}

    async def verify(self, task: dict[str, Any], response: Response) -> Verdict:
        if task.get("_ng_rollout_index") == task.get("fail_index", -1):
            raise RuntimeError("this repeat's verify broke")
        hold = task.get("hold_file")
        if hold:
            first_run = os.path.exists(hold)
            if task.get("_ng_rollout_index") == task.get("hold_index"):
                while os.path.exists(hold):
                    open(hold + ".held", "w").close()
                    await asyncio.sleep(0.05)
            return Verdict(reward=1.0, fields={"first_run": first_run})
        size = int(task.get("cohort_size", 1))
        key = (task.get("batch_key"), task.get("_ng_task_index"))
        cohort = self.cohorts.setdefault(key, _Cohort())
        cohort.members.append(int(task.get("_ng_rollout_index", -1)))
        if len(cohort.members) >= size:
            cohort.full.set()
        try:
            await asyncio.wait_for(cohort.full.wait(), float(task.get("cohort_wait_s", 5.0)))
        except TimeoutError:
            return Verdict(reward=0.0, fields={"cohort": sorted(cohort.members)})
        return Verdict(reward=1.0, fields={"cohort": sorted(cohort.members)})
