"""NeMo Gym's ``ServerClient`` for a server or agent we host: its calls by name are answered by our host first.

NeMo Gym's servers reach each other by name through ``server_client.request(server_name, url_path, ...)`` over
HTTP. Hosted here, a call to a model the config names goes over the bus, and an agent's calls to itself or to its
rollout's resource are routed by its ``AgentHost``: the host's ``answer`` says, and what it leaves (``NOT_MINE``)
goes over HTTP as NeMo Gym would send it. nemo-gym is imported on first use (it is the hosted environment's).
"""

from __future__ import annotations

import functools
from typing import Any, Protocol

NOT_MINE = object()  # ``Answers.answer``: not a call this host answers


class Answers(Protocol):
    async def answer(self, server_name: str, url_path: str, method: str, kwargs: dict[str, Any]) -> Any:
        """The reply to a ``server_client`` call by name, or ``NOT_MINE``."""


def server_client(host: Answers, global_config: dict[str, Any]) -> Any:
    """A ``ServerClient`` over ``global_config`` whose calls ``host`` answers first."""
    from nemo_gym.server_utils import BaseServerConfig
    from omegaconf import OmegaConf

    client = _client_class()(
        head_server_config=BaseServerConfig(host="127.0.0.1", port=0),
        global_config_dict=OmegaConf.create(global_config),
    )
    client._gym_host = host
    return client


@functools.cache
def _client_class() -> type:
    from nemo_gym.server_utils import ServerClient
    from pydantic import PrivateAttr

    class HostedServerClient(ServerClient):
        _gym_host: Any = PrivateAttr(default=None)

        async def request(self, server_name: str, url_path: str, method: str, **kwargs: Any) -> Any:
            host = self._gym_host
            if host is not None:
                out = await host.answer(server_name, url_path, method, kwargs)
                if out is not NOT_MINE:
                    return out
            return await super().request(server_name=server_name, url_path=url_path, method=method, **kwargs)

    return HostedServerClient
