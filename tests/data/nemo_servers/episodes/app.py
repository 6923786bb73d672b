"""A NeMo Gym resources server in toolsandbox's protocol, written for gym-runtime's hosting tests.

``/seed_session`` opens an episode and answers its ``env_id``, observations and tools; ``/step``
and ``/close`` name the episode by ``env_id``; ``/close`` scores it (the calls of ``add`` summed,
divided by 10) and ``/verify`` reads that score by ``response.env_id``, as toolsandbox does.
A call of ``explode`` makes ``/step`` raise (NeMo Gym's HTTP 500).
"""

import uuid

from fastapi import FastAPI
from nemo_gym.base_resources_server import BaseResourcesServerConfig, SimpleResourcesServer
from pydantic import BaseModel, ConfigDict, Field


class SeedRequest(BaseModel):
    task_idx: int


class StepRequest(BaseModel):
    env_id: str
    function_calls: list[dict] = Field(default_factory=list)
    text: str | None = None


class CloseRequest(BaseModel):
    env_id: str


class VerifyRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    response: dict


def _tool(name: str) -> dict:
    params = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3}}, "required": ["n"]}
    return {"type": "function", "name": name, "description": name, "parameters": params, "strict": False}


class EpisodesServer(SimpleResourcesServer):
    config: BaseResourcesServerConfig
    envs: dict = Field(default_factory=dict)
    scores: dict = Field(default_factory=dict)

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/step")(self.step)
        app.post("/close")(self.close)
        return app

    async def seed_session(self, body: SeedRequest) -> dict:
        env_id = str(uuid.uuid4())
        self.envs[env_id] = {"total": 0, "steps": 0}
        tools = [_tool("add"), *([_tool("explode")] if body.task_idx == 1 else [])]
        obs = [{"role": "user", "content": f"task {body.task_idx}: add, then tell me"}]
        return {"env_id": env_id, "scenario": f"task-{body.task_idx}", "obs": obs, "tools": tools}

    async def step(self, body: StepRequest) -> dict:
        st = self.envs[body.env_id]  # an unknown env_id raises: HTTP 500
        st["steps"] += 1
        obs = []
        for call in body.function_calls:
            if call["name"] == "explode":
                raise RuntimeError("the episode exploded")
            st["total"] += 1
            obs.append({"type": "function_call_output", "call_id": call["call_id"], "output": f"added {st['total']}"})
        return {"obs": obs, "reward": 0.0, "done": not body.function_calls}

    async def close(self, body: CloseRequest) -> dict:
        st = self.envs.pop(body.env_id, None)
        if st is not None:
            self.scores[body.env_id] = {"reward": st["total"] / 10, "steps": st["steps"]}
        return {"message": "Success", "success": True}

    async def verify(self, body: VerifyRequest) -> dict:
        score = self.scores.pop(body.response.get("env_id"), {"reward": 0.0, "steps": None})
        return {**body.model_dump(), **score}


if __name__ == "__main__":
    EpisodesServer.run_webserver()
