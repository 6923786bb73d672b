"""A NeMo Gym resources server written for gym-runtime's hosting tests (a server of a "checkout").

``boom`` crashes (NeMo Gym answers HTTP 500 with ``repr(e)``, which its simple agent shows
the model); ``started`` reports whether the lifespan hook ran; ``verify`` tags its row with
``_ng_failure_class`` as NeMo Gym's judge failsafe does.
"""

from contextlib import asynccontextmanager

from fastapi import FastAPI
from nemo_gym.base_resources_server import BaseResourcesServerConfig, BaseVerifyRequest, SimpleResourcesServer
from pydantic import BaseModel


class BoomRequest(BaseModel):
    n: int


class CrashyConfig(BaseResourcesServerConfig):
    label: str = "default"


class CrashyServer(SimpleResourcesServer):
    config: CrashyConfig
    lifespan_ran: bool = False

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()

        @asynccontextmanager
        async def lifespan(_app: FastAPI):
            self.lifespan_ran = True
            yield

        app.router.lifespan_context = lifespan
        app.post("/boom")(self.boom)
        app.post("/started")(self.started)
        return app

    async def boom(self, body: BoomRequest) -> dict:
        raise ValueError(f"boom {body.n}")

    async def started(self) -> dict:
        return {"lifespan_ran": self.lifespan_ran, "label": self.config.label}

    async def verify(self, body: BaseVerifyRequest) -> dict:
        return {**body.model_dump(), "reward": 0.25, "_ng_failure_class": "crashy_verdict"}


if __name__ == "__main__":
    CrashyServer.run_webserver()
