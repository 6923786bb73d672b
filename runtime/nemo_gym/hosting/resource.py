"""What the workers use of hosting: a resource worker's for a hosted NeMo Gym server (``resources.NAME.nemo_gym``),
an agent worker's for an agent module that runs in verifiers' own built environment (``ensure_verifiers``).

``resolve_config`` loads this module by name (``config.HOSTED_RESOURCE_MODULE``), as it loads agent modules,
and hands it to the workers in the ``ResolvedConfig``: the workers import nothing from
``gym_runtime.nemo_gym.hosting`` but the guest process's entry (``workers.guest_main``), which runs the server.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from gym_runtime.nemo_gym.hosting.env import HOSTED_ENV, HostedEnv, ensure_verifiers, nemo_gym_version
from gym_runtime.nemo_gym.hosting.env import ensure as env
from gym_runtime.nemo_gym.hosting.host import CalledSessions, ServerHost, hosted_class
from gym_runtime.plugins import tree_hash

__all__ = [
    "HOSTED_ENV",
    "CalledSessions",
    "HostedEnv",
    "ServerHost",
    "ensure_verifiers",
    "env",
    "hosted_class",
    "identity",
]


def identity(server: str, server_dir: str | None) -> str:
    """A hosted NeMo Gym server's code identity: nemo-gym's version, the server's name and its files' hash."""
    code = tree_hash(Path(server_dir)) if server_dir else ""
    return hashlib.sha256(f"nemo_gym=={nemo_gym_version()}:{server}:{code}".encode()).hexdigest()[:12]
