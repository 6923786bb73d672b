"""A NeMo Gym resources server that probes its judge before serving, as xstest does (gym-runtime's tests).

xstest's ``setup_webserver`` waits until ``server_client.poll_for_status(judge)`` (a ``requests.get`` of the
judge's base URL) succeeds and a ``requests.post`` to its ``/v1/responses`` gets any HTTP answer, retrying
every 10 s for ever; this one tries once and raises, so a probe that cannot get through fails fast. Its
``verify`` asks the judge through ``server_client`` and rewards any answer. With ``missing`` set, its start
fails as rolemrc's does here (NLTK's LookupError for a corpus it would download).
"""

import requests
from nemo_gym.base_resources_server import BaseResourcesServerConfig, BaseVerifyRequest, SimpleResourcesServer
from nemo_gym.config_types import ModelServerRef
from nemo_gym.global_config import get_first_server_config_dict


class ProberConfig(BaseResourcesServerConfig):
    judge_model_server: ModelServerRef
    missing: str | None = None  # a resource its start looks up and does not find (as rolemrc's NLTK corpora)


class ProberServer(SimpleResourcesServer):
    config: ProberConfig

    def setup_webserver(self):
        if self.config.missing:
            raise LookupError(f"\n{'*' * 20}\n  Resource {self.config.missing!r} not found.\n  Please download it.\n")
        name = self.config.judge_model_server.name
        status = self.server_client.poll_for_status(name)
        if status != "success":
            raise RuntimeError(f"judge {name!r} not reachable: {status}")
        url = self.server_client._build_server_base_url(
            get_first_server_config_dict(self.server_client.global_config_dict, name)
        )
        try:
            requests.post(f"{url}/v1/responses", json={"input": []}, timeout=10)
        except (requests.exceptions.ConnectionError, requests.exceptions.Timeout) as e:
            raise RuntimeError(f"judge backend not reachable through {name!r}: {e!r}") from None
        return super().setup_webserver()

    async def verify(self, body: BaseVerifyRequest) -> dict:
        reply = await self.server_client.post(
            server_name=self.config.judge_model_server.name, url_path="/v1/responses", json={"input": "grade this"}
        )
        said = (await reply.json())["output"]
        return {**body.model_dump(mode="json"), "reward": 1.0 if said else 0.0}


if __name__ == "__main__":
    ProberServer.run_webserver()
