"""A verifiers 0.4 taskset (Taskset x Harness) for tests/e2e/test_verifiers_04.py, written as verifiers' own docs
and shipped tasksets write one: ``say COLOR`` tasks scored by exact match.

``task.kind`` (``--env.taskset.task.kind``): ``single`` (one reply), ``tool`` (a ``get_color`` tool over MCP that the
model calls first), ``multi`` (a scripted user says "again" twice: three assistant turns, each scored),
``raises`` (a reward function that raises).
Grouped scoring is verifiers' own ``best_of_n`` env over this taskset (``--env.id best_of_n``).
"""

from vf04_suite.taskset import ColorEnv, ColorTaskset

__all__ = ["ColorEnv", "ColorTaskset"]
