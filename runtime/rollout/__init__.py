"""The rollout's room: one rollout's state and the rules that keep it, below the agent author's API.

``ledger`` (its one set of books: turns, calls, cost, policy versions, repeats, the trajectory so far),
``state`` (``Rollout``: the task, its clock, ledger, sessions, sandboxes and checkpoints, and its model calls),
``session`` (one environment session as the rollout holds it), ``checkpoint`` (when one is due, what it holds,
where it is kept), ``resume`` (the turn's checkpoints, tool-call ids, and taking a checkpoint up) and ``port``
(the two ways a rollout reaches the world, model calls and session operations: over the bus or in this process).
``gym_runtime.agent`` (``AgentContext``, ``Session``, ``Trajectory``) is its face and imports it; nothing here
imports that face.
"""
