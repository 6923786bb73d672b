"""Kept for configs and plugins: the old path of NeMo Gym's hosting (now ``gym_runtime.nemo_gym.hosting``, its
parity ``gym_runtime.nemo_gym.parity``) and of Harbor's image builder (now ``gym_runtime.harbor.hosting``).

``import gym_runtime.hosting.agent`` (a saved config's hosted agent) and ``python -m gym_runtime.hosting.harbor``
find the moved modules: each old name is bound to its module in ``sys.modules`` when this package loads, so an
old path and the new one are the same module, not a copy. New code imports the new paths. Not
``sandbox_provider``: it imports NeMo Gym itself, so it loads only in a hosted server's environment, which finds
it by the package's entry point (its new path; an environment is rebuilt when the entry points change).
"""

import sys

from gym_runtime.harbor import hosting as harbor
from gym_runtime.nemo_gym import catalogue, parity
from gym_runtime.nemo_gym.hosting import (
    agent,
    asgi,
    env,
    host,
    middleware,
    resource,
    server_client,
)

MOVED = {
    "agent": agent,
    "asgi": asgi,
    "catalogue": catalogue,
    "env": env,
    "harbor": harbor,
    "host": host,
    "middleware": middleware,
    "parity": parity,
    "resource": resource,
    "server_client": server_client,
}
sys.modules.update({f"{__name__}.{name}": module for name, module in MOVED.items()})
