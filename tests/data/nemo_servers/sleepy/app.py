"""A NeMo Gym resources server whose ``verify`` blocks its event loop, written for gym-runtime's hosting tests.

A row's ``block_s`` is how long its verify sleeps synchronously (``time.sleep``: nothing else on
the server's loop runs meanwhile), as toolsandbox's ``/close`` scores an episode on the loop for
13-45 s; the reward is 1.0 and ``blocked_s`` reports the sleep.
"""

import time

from nemo_gym.base_resources_server import BaseResourcesServerConfig, BaseVerifyRequest, SimpleResourcesServer
from pydantic import ConfigDict


class SleepyVerifyRequest(BaseVerifyRequest):
    model_config = ConfigDict(extra="allow")
    block_s: float = 0.0


class SleepyServer(SimpleResourcesServer):
    config: BaseResourcesServerConfig

    async def verify(self, body: SleepyVerifyRequest) -> dict:
        time.sleep(body.block_s)  # blocks the loop, as a synchronous grader does
        return {**body.model_dump(), "reward": 1.0, "blocked_s": body.block_s}


if __name__ == "__main__":
    SleepyServer.run_webserver()
