"""A NeMo Gym resources server whose ``verify`` holds the GIL, written for gym-runtime's isolation tests.

A row's ``hog_kb`` has its verify run NeMo Gym's kind of grader regex (imo_proofbench_judge's, quadratic on
repeated ``\\(``) on an answer of that many KB: Python's ``re`` never releases the GIL while it searches, so
every thread of the process stops with it (a hosted worker's bus too, unless the server runs in a guest).
"""

import re

from nemo_gym.base_resources_server import BaseResourcesServerConfig, BaseVerifyRequest, SimpleResourcesServer
from pydantic import ConfigDict

SPAN = re.compile(r"\\\((.*?)\\\)", re.S)


class GilHogVerifyRequest(BaseVerifyRequest):
    model_config = ConfigDict(extra="allow")
    hog_kb: int = 0


class GilHogServer(SimpleResourcesServer):
    config: BaseResourcesServerConfig

    async def verify(self, body: GilHogVerifyRequest) -> dict:
        if body.hog_kb:
            SPAN.search("\\(" * (body.hog_kb * 512))
        return {**body.model_dump(), "reward": 1.0}


if __name__ == "__main__":
    GilHogServer.run_webserver()
