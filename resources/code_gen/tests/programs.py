"""What the code_gen tests share: a session with test limits, fenced programs, stdio tasks, a health check."""

from __future__ import annotations

from typing import Any

from gym_runtime.messages import Response
from gym_runtime.resources.code_gen import CodeGen
from gym_runtime.testing import text_response


def fenced(code: str) -> Response:
    return text_response(f"Here you go.\n\n```python\n{code}\n```\n")


async def session(**options: Any) -> CodeGen:
    await CodeGen.setup(options)
    return CodeGen()


def stdio_task(inputs: list[str], outputs: list[str]) -> dict[str, Any]:
    return {
        "responses_create_params": {"input": [{"role": "user", "content": "solve"}]},
        "verifier_metadata": {"unit_tests": {"inputs": inputs, "outputs": outputs, "fn_name": None}},
    }


ADD = stdio_task(["1 2\n", "10 -3\n"], ["3\n", "7\n"])


# The start of a program that tries system calls: ``tryit(name, number, *args)`` is "name=ok" or "name=<errno
# name>" (the child of a clone that succeeded exits at once).
SYSCALLS = """
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def tryit(name, *args):
    r = libc.syscall(*args)
    e = ctypes.get_errno()
    if r == 0 and name == 'clone':
        os._exit(0)  # the child of a successful clone
    return name + ('=ok' if r >= 0 else '=' + errno.errorcode.get(e, str(e)))
"""

FAST = {"unit_test_timeout_secs": 0.5, "wall_time_s": 3, "memory_mb": 1024, "max_parallel": 2}


async def still_works(env: CodeGen) -> None:
    """The worker survived: the next verify runs and grades a correct program."""
    out = await env.verify(ADD, fenced(ADD_OK))
    assert out.reward == 1.0 and out.fields["result"] == [True, True]


ADD_OK = "a, b = map(int, input().split())\nprint(a + b)"
