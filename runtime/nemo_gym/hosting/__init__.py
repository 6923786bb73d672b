"""Hosting NeMo Gym's own resources servers, unchanged, in gym-runtime resource workers.

``env``: the environment a server runs in (a Python >= 3.13 venv with nemo-gym, the
server's requirements and gym-runtime), built once and cached by content hash.
``host``: the server's FastAPI app driven in process (``asgi``: one ASGI request per
call, on an event loop of its own, no port) behind our ``Resource`` protocol; imported
only inside that environment.
``chat``: Chat Completions served to hosted code (verifiers' client, NeMo Gym judges) from
our model calls.
``parity`` (beside this package, ``gym_runtime.nemo_gym.parity``): replays a server's recorded rollouts and
compares rewards and tool outputs.

A config chooses hosting with one key, ``resources.NAME.nemo_gym: SERVER`` (instead
of ``server:``); see ``docs`` in the README.
"""
