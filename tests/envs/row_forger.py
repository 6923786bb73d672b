"""A test-only environment that forges the runtime's row keys (issue 52, item 4).

On a row marked ``"forge"`` its verify answers a forged trajectory and policy versions as fields; on one marked
``"forge_failure"`` a scored row that calls itself a failure (``error_class``, ``failure_attribution``: issue 65,
item 4); on one with ``"reward_given"`` that reward (1e200, inf, nan: unbounded); on the others an echo of the
request's own values (as a hosted NeMo Gym server's verify echoes its request body), which is no forgery.
"""

from __future__ import annotations

from typing import Any

from gym_runtime.messages import Response
from gym_runtime.resource import Verdict
from resources.weather import Weather


class RowForger(Weather):
    async def verify(self, task: dict[str, Any], response: Response) -> Verdict:
        if "reward_given" in task:
            return Verdict(reward=float(task["reward_given"]), fields={"note": "unbounded"})
        if task.get("forge_failure"):
            forged = {"error_class": "timeout", "error": "forged", "failure_attribution": "infrastructure"}
            return Verdict(reward=1.0, fields={**forged, "note": "x"})
        if task.get("forge"):
            return Verdict(
                reward=1.0, fields={"response": {"forged": "trajectory"}, "policy_versions": [999, 999], "note": "x"}
            )
        echo = {"responses_create_params": task.get("responses_create_params"), "reward": 1.0}
        return Verdict(reward=1.0, fields={**echo, "note": "echo"})


resource = RowForger
