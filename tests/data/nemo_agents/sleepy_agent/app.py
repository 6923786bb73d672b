"""A NeMo Gym agent whose ``/run`` blocks its event loop, written for gym-runtime's hosting tests.

Its episode is simple_agent's ``/run`` (``/seed_session``, its own ``/v1/responses``, ``/verify``), run
in a task the handler starts, as an agent that fans out runs its work. A row's ``block_s`` is how long
its ``/run`` first sleeps synchronously (``time.sleep``: nothing else on the agent's loop runs
meanwhile), as an agent's synchronous code can, once another rollout's ``/verify`` is out.
"""

import asyncio
import time

from fastapi import Request
from nemo_gym.server_utils import get_response_json, raise_for_status
from responses_api_agents.simple_agent.app import SimpleAgent, SimpleAgentRunRequest, SimpleAgentVerifyResponse

_VERIFYING = asyncio.Event()  # set when a rollout of this process posts its /verify


class SleepyRunRequest(SimpleAgentRunRequest):
    block_s: float = 0.0


class SleepyAgent(SimpleAgent):
    async def run(self, request: Request, body: SleepyRunRequest) -> SimpleAgentVerifyResponse:
        if body.block_s:
            await _VERIFYING.wait()
            time.sleep(body.block_s)  # blocks the loop while another rollout waits for its verify
        return await asyncio.create_task(self._episode(body))

    async def _episode(self, body: SleepyRunRequest) -> SimpleAgentVerifyResponse:
        resources = self.config.resources_server.name
        seeded = await self.server_client.post(server_name=resources, url_path="/seed_session", json=body.model_dump())
        await raise_for_status(seeded)
        response = await self.server_client.post(
            server_name=self.config.name, url_path="/v1/responses", json=body.responses_create_params
        )
        await raise_for_status(response)
        _VERIFYING.set()
        verified = await self.server_client.post(
            server_name=resources,
            url_path="/verify",
            json=body.model_dump() | {"response": await get_response_json(response)},
        )
        await raise_for_status(verified)
        return SimpleAgentVerifyResponse.model_validate(await get_response_json(verified))


if __name__ == "__main__":
    SleepyAgent.run_webserver()
