"""NeMo Gym, integrated in one place: everything gym-runtime knows of NeMo Gym's code and formats.

- ``config``: NeMo Gym's config files read and converted to ours; the reader itself is
  ``gym_runtime.config.nemo_gym``, beside the config it writes (``load_config`` calls it when a file has NeMo
  Gym's shape), so the config layer imports nothing of this package and the two rooms make no circle.
- ``hosting``: NeMo Gym's own resources servers and agents run unchanged in our workers (their built
  environments, the in-process ASGI host, the sandbox provider their configs name).
- ``parity``: a hosted server replayed against its recorded rollouts (``gym-runtime parity``), and
  ``catalogue``: what the recordings of NeMo Gym 0.7's servers explain.

Elsewhere, by design: the gateway that speaks NeMo Gym's HTTP protocols to trainers (``gym_runtime.gateway``,
above the client), and the guest process (``workers/guest*.py``) that runs a hosted server's code apart from the
bus, as it runs any environment's with ``isolation: process``.
"""
