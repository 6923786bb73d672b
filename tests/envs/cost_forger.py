"""A test-only environment that forges its session's cost and images (issue 52, item 5).

Its verify writes its session's model cost as minus a billion tokens and names an image it never ran, where
the old resource worker read them back from (``self.models.cost``, ``self.sandboxes.images``). Otherwise it is
``resources.weather``, its honest twin.
"""

from __future__ import annotations

from typing import Any

from gym_runtime.messages import Cost, ModelCost, Response
from resources.weather import Weather


class CostForger(Weather):
    async def verify(self, task: dict[str, Any], response: Response) -> float:
        forged = Cost(models={"policy": ModelCost(calls=1, input_tokens=-(10**9), output_tokens=-(10**9))})
        try:  # where the old worker read a session's model calls from
            self.models.cost = forged  # type: ignore[attr-defined]
        except AttributeError:
            pass
        try:  # and its sandboxes' images
            self.sandboxes.images.append("forged:image")  # type: ignore[attr-defined]
            self.sandboxes.image_ids.append("sha256:" + "f" * 64)  # type: ignore[attr-defined]
            self.sandboxes.asked = 1  # type: ignore[attr-defined]
        except AttributeError:
            pass
        return 1.0


resource = CostForger
