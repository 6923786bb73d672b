"""A NeMo Gym resources server with a judge, written for gym-runtime's parity tests (``polymath``'s shape).

Its grader decides a boxed answer itself (``\\boxed{4}`` right, any other boxed answer wrong) and asks its
judge (``judge_model_server``) only about an answer it cannot parse, as math_with_judge's library check does
before its judge fallback. Its recordings hold no judge call, so ``parity`` replays the rows the grader
decides and refuses the one that needed the judge.
"""

from nemo_gym.base_resources_server import BaseResourcesServerConfig, BaseVerifyRequest, SimpleResourcesServer
from nemo_gym.config_types import ModelServerRef


class JudgedConfig(BaseResourcesServerConfig):
    judge_model_server: ModelServerRef


class JudgedServer(SimpleResourcesServer):
    config: JudgedConfig

    async def verify(self, body: BaseVerifyRequest) -> dict:
        out = body.model_dump(mode="json")
        text = "".join(
            part.get("text", "")
            for item in out["response"]["output"]
            if item.get("type") == "message"
            for part in item.get("content") or []
        )
        if "\\boxed{" in text:
            return {**out, "reward": 1.0 if "\\boxed{4}" in text else 0.0}
        asked = {"input": [{"role": "user", "content": f"Does {text!r} say 4? Answer EQUAL or NOT_EQUAL."}]}
        reply = await self.server_client.post(
            server_name=self.config.judge_model_server.name, url_path="/v1/responses", json=asked
        )
        said = "".join(
            part.get("text", "")
            for item in (await reply.json()).get("output", [])
            if item.get("type") == "message"
            for part in item.get("content") or []
        )
        return {**out, "reward": 1.0 if said.startswith("EQUAL") else 0.0}


if __name__ == "__main__":
    JudgedServer.run_webserver()
