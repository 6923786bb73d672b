"""A NeMo Gym resources server whose ``verify`` blocks its event loop, written for gym-runtime's hosting tests.

A row's ``block_s`` is how long its verify sleeps synchronously (``time.sleep``: nothing else on
the server's loop runs meanwhile), as toolsandbox's ``/close`` scores an episode on the loop for
13-45 s; the reward is 1.0 and ``blocked_s`` reports the sleep. A row's ``alarm_s`` arms a
``signal.alarm`` timeout around that sleep, as math-verify's does (it works on the main thread only):
``alarm_fired`` says whether it cut the sleep short.
"""

import signal
import time

from nemo_gym.base_resources_server import BaseResourcesServerConfig, BaseVerifyRequest, SimpleResourcesServer
from pydantic import ConfigDict


class SleepyVerifyRequest(BaseVerifyRequest):
    model_config = ConfigDict(extra="allow")
    block_s: float = 0.0
    alarm_s: int = 0


def _timeout(signum, frame):
    raise TimeoutError


class SleepyServer(SimpleResourcesServer):
    config: BaseResourcesServerConfig

    async def verify(self, body: SleepyVerifyRequest) -> dict:
        fired = False
        if body.alarm_s:
            old = signal.signal(signal.SIGALRM, _timeout)  # ValueError off the main thread
            signal.alarm(body.alarm_s)
        try:
            time.sleep(body.block_s)  # blocks the loop, as a synchronous grader does
        except TimeoutError:
            fired = True
        finally:
            if body.alarm_s:
                signal.alarm(0)
                signal.signal(signal.SIGALRM, old)
        return {**body.model_dump(), "reward": 1.0, "blocked_s": body.block_s, "alarm_fired": fired}


if __name__ == "__main__":
    SleepyServer.run_webserver()
