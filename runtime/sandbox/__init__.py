"""The sandbox for model-written programs, shared by every environment that runs them.

``code_gen`` (a program against unit tests) and ``swe``'s local backend (a
repository and a shell) both run untrusted code here; neither imports the other.
The parent side is :class:`SandboxRunner` (``runner.py``); the child side is the
same file run alone as ``python -I runner.py --child`` (standard library only),
and ``cgroups.py`` gives each sandbox its memory and process budget.
``python -m gym_runtime.sandbox.runner`` prints what this machine offers.
"""

from gym_runtime.sandbox.runner import (
    Limits,
    SandboxError,
    SandboxExited,
    SandboxRunner,
    SandboxSession,
    SandboxTimeout,
    landlock_abi,
    probe,
)

__all__ = [
    "Limits",
    "SandboxError",
    "SandboxExited",
    "SandboxRunner",
    "SandboxSession",
    "SandboxTimeout",
    "landlock_abi",
    "probe",
]
