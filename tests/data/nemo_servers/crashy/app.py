"""A NeMo Gym resources server written for gym-runtime's hosting tests (a server of a "checkout").

``boom`` crashes (NeMo Gym answers HTTP 500 with ``repr(e)``, which its simple agent shows
the model); ``started`` reports whether the lifespan hook ran; ``verify`` tags its row with
``_ng_failure_class`` as NeMo Gym's judge failsafe does. ``inner`` fails as a call to an inner
server that answered an error does (``raise_for_status``'s ``ClientResponseError``), ``cancelled``
with a cancellation of the server's own, ``session`` answers the request's session id: what
``tests/data/nemo_servers/middleware_parity.py`` compares between NeMo Gym's middleware and ours.
"""

import asyncio
from contextlib import asynccontextmanager

from aiohttp import ClientResponseError, RequestInfo
from fastapi import FastAPI, Request
from nemo_gym.base_resources_server import BaseResourcesServerConfig, BaseVerifyRequest, SimpleResourcesServer
from nemo_gym.server_utils import SESSION_ID_KEY
from pydantic import BaseModel
from yarl import URL


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
        app.post("/inner")(self.inner)
        app.post("/cancelled")(self.cancelled)
        app.post("/session")(self.session)
        return app

    async def boom(self, body: BoomRequest) -> dict:
        raise ValueError(f"boom {body.n}")

    async def started(self) -> dict:
        return {"lifespan_ran": self.lifespan_ran, "label": self.config.label}

    async def inner(self) -> dict:
        url = URL("http://judge.invalid/v1/responses")
        e = ClientResponseError(RequestInfo(url, "POST", {}, url), (), status=502, message="Bad Gateway")
        e.response_content = b"the judge is down"
        raise e

    async def cancelled(self) -> dict:
        raise asyncio.CancelledError

    async def session(self, request: Request) -> dict:
        return {"session_id": request.session.get(SESSION_ID_KEY)}

    async def verify(self, body: BaseVerifyRequest) -> dict:
        return {**body.model_dump(), "reward": 0.25, "_ng_failure_class": "crashy_verdict"}


if __name__ == "__main__":
    CrashyServer.run_webserver()
