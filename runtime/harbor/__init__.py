"""Harbor (the Terminal-Bench team's task format and runner), integrated in one place.

- ``tasks``: a task directory read as Harbor reads it (``task.toml``, rewards by Harbor's rules, the image a
  task is built into, named by content hash): an author API, shared by the ``harbor`` environment
  (``resources/harbor``) and the image builder; its names are re-exported here (``from gym_runtime.harbor
  import find_tasks``, the path plugins have always used).
- ``dockerfile_from``: a Dockerfile's ``FROM`` lines resolved as ``docker build`` resolves them (only the image
  builder needs it).
- ``hosting``: the tasks' images built through the engine's API, and the parity config that runs their oracle
  (``gym-runtime parity harbor``; ``python -m gym_runtime.harbor.hosting`` builds images ahead).

The plugins stay where the plugin rule finds them by name: the environment ``resources/harbor`` and the
oracle agent ``agents/harbor_oracle.py`` (a task's ``solve.sh`` as the policy).
"""

from gym_runtime.harbor import tasks
from gym_runtime.harbor.tasks import *  # noqa: F403 (the task format's public names: one list, tasks.__all__)

__all__ = tasks.__all__
