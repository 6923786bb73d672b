"""Deprecated, removed in gym-runtime 0.2.0 (``gym_runtime.moved.REMOVED_IN``): the old path of NeMo Gym's hosting
(now ``gym_runtime.nemo_gym.hosting``, its parity and catalogue ``gym_runtime.nemo_gym.parity``/``.catalogue``) and
of Harbor's image builder (now ``gym_runtime.harbor.hosting``).

``import gym_runtime.hosting.agent`` (a saved config's hosted agent) and ``python -m gym_runtime.hosting.harbor``
find the moved modules: the first import of an old name warns (``DeprecationWarning``, naming the new path) and
binds it to the moved module itself in ``sys.modules``, not a copy. Nothing is imported until an old name is
asked for. New code imports the new paths. Not ``sandbox_provider``: it imports NeMo Gym itself, so it loads only
in a hosted server's environment, which finds it by the package's entry point (its new path).
"""

from gym_runtime.moved import MovedModules

_HOSTING = "gym_runtime.nemo_gym.hosting"
MOVED = {
    **{name: f"{_HOSTING}.{name}" for name in ("agent", "asgi", "env", "host", "middleware", "resource")},
    "server_client": f"{_HOSTING}.server_client",
    "catalogue": "gym_runtime.nemo_gym.catalogue",
    "parity": "gym_runtime.nemo_gym.parity",
    "harbor": "gym_runtime.harbor.hosting",
}
_finder = MovedModules(__name__, MOVED)
_finder.install()
__getattr__ = _finder.getattr  # ``gym_runtime.hosting.agent`` as an attribute: imported and warned about as above
