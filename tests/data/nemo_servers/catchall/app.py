"""A NeMo Gym resources server whose tools are one catch-all route, ``POST /{tool_name}`` (as citation_if,
ns_tools, math_advanced_calculations and others of the catalogue declare theirs), for gym-runtime's tests.

A tool answers ``{"tool": name}`` (``{"detail": "no tool ..."}`` for a name starting with ``x``, its own
answer to an unknown tool); ``verify`` pays 1.0 for a response that says ``secret``: a policy that could
reach it would learn its reward.
"""

from fastapi import FastAPI
from nemo_gym.base_resources_server import BaseResourcesServerConfig, BaseVerifyRequest, SimpleResourcesServer


class CatchallServer(SimpleResourcesServer):
    config: BaseResourcesServerConfig

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/{tool_name}")(self.tool)
        return app

    async def tool(self, tool_name: str) -> dict:
        if tool_name.startswith("x"):
            return {"detail": f"no tool {tool_name}"}
        return {"tool": tool_name}

    async def verify(self, body: BaseVerifyRequest) -> dict:
        said = "".join(c.text for o in body.response.output if o.type == "message" for c in o.content)
        return {**body.model_dump(), "reward": 1.0 if "secret" in said else 0.0}


if __name__ == "__main__":
    CatchallServer.run_webserver()
