"""A NeMo Gym resources server that calls others, written for gym-runtime's hosting tests.

Its ``verify`` does what catalogue servers do with other servers (ns_tools, judges):
``server_client.post`` to another resources server by name, as one session (seed, a tool,
verify, the seed's cookies carried as NeMo Gym's agents carry them); a request of its own
``NeMoGymAsyncOpenAI`` client on a base URL from its config (as verifif's judge client);
the ``openai`` package's own clients, async and sync (in a thread, as gdpval's), on a base URL
from its config; and a call to a third server (``other``), whose HTTP status it reports.
"""

import asyncio

import openai
from nemo_gym.base_resources_server import BaseResourcesServerConfig, BaseVerifyRequest, SimpleResourcesServer
from nemo_gym.openai_utils import NeMoGymAsyncOpenAI


class CallerConfig(BaseResourcesServerConfig):
    grader: str = "counter"
    other: str | None = None
    judge_base_url: str | None = None
    openai_base_url: str | None = None


class CallerServer(SimpleResourcesServer):
    config: CallerConfig

    async def verify(self, body: BaseVerifyRequest) -> dict:
        out = body.model_dump(mode="json")
        request = {"responses_create_params": out["responses_create_params"]}
        seed = await self.server_client.post(
            server_name=self.config.grader, url_path="/seed_session", json={**request, "initial_count": 3}
        )
        cookies = seed.cookies
        await self.server_client.post(
            server_name=self.config.grader, url_path="/increment_counter", json={"count": 2}, cookies=cookies
        )
        graded = await self.server_client.post(
            server_name=self.config.grader,
            url_path="/verify",
            json={**out, "expected_count": 5},  # 3 + 2 only if every call reached the same session
            cookies=cookies,
        )
        reward = (await graded.json())["reward"]
        if self.config.judge_base_url:
            client = NeMoGymAsyncOpenAI(base_url=self.config.judge_base_url, api_key="unused")
            chat = await client.create_chat_completion(
                model="any", messages=[{"role": "user", "content": "grade this"}], max_tokens=16
            )
            out["judge_said"] = chat["choices"][0]["message"]["content"]
        if self.config.openai_base_url:
            messages = [{"role": "user", "content": "grade this"}]
            aclient = openai.AsyncOpenAI(base_url=self.config.openai_base_url, api_key="unused", max_retries=0)
            chat = await aclient.chat.completions.create(model="any", messages=messages)
            out["openai_said"] = chat.choices[0].message.content
            sclient = openai.OpenAI(base_url=self.config.openai_base_url, api_key="unused", max_retries=0)
            chat = await asyncio.to_thread(sclient.chat.completions.create, model="any", messages=messages)
            out["openai_sync_said"] = chat.choices[0].message.content
        if self.config.other:
            reply = await self.server_client.post(
                server_name=self.config.other,
                url_path="/verify",
                json={**out, "initial_count": 1, "expected_count": 1},
            )
            out["other_status"] = reply.status
            out["other_said"] = (await reply.text())[:300]
        return {**out, "reward": reward}


if __name__ == "__main__":
    CallerServer.run_webserver()
