"""Placement of a config's worker replicas on a cluster scheduler: Ray (``start --ray``; the ``ray`` extra).

Beside the other deploy targets (Compose, Kubernetes with KEDA, Slurm: ``deploy/``), which run ``gym-runtime
start`` as their own processes, this package runs it from Ray: ``backlog`` (each role's backlog signal, read from
the bus, with no Ray import: KEDA's recipe reads the same counts), ``actors`` (a Ray actor holding one worker
process, as ``start`` runs it), ``pools`` (each role's actors, placed with the resources the config asks for, and
where NATS runs), ``scaler`` (actors added and drained by backlog, resources asked of Ray's autoscaler).
"""
