"""A sandbox environment that can be set up once for its group (``seed_once``: issue 78 item 2).

Its ``seed`` is the set-up: it opens the session's sandbox and builds the task's files in it (``built``, then
the ``setup`` command of its options, e.g. a build: tests/bench/fork.py; noted in the ``seeds`` file of its
options). ``bump`` counts in a file of that sandbox; ``verify`` rewards a session whose sandbox has the task's build
and a count of exactly 1: a repeat that saw another's bump (a sandbox shared, not forked) scores 0. Its snapshot is
the task's name; ``restore`` opens the session's sandbox again: with ``seed_once``, the fork of the template's.
"""

from __future__ import annotations

from typing import Any

from gym_runtime.messages import Response
from gym_runtime.resource import Resource, Verdict, tool
from tests.envs.seeded_ledger import note_seed


def task(name: str) -> dict[str, Any]:
    """A task offering ``bump`` (the scripted policy calls it once, then answers)."""
    return {
        "responses_create_params": {
            "input": [{"role": "user", "content": f"bump {name}"}],
            "tools": [{"type": "function", "name": "bump", "parameters": {"type": "object", "properties": {}}}],
        },
        "name": name,
    }


class SeededBox(Resource):
    async def seed(self, task: dict[str, Any]) -> None:
        note_seed(self.options, task["name"])
        self.name = task["name"]
        self.box = await self.sandbox()
        setup = self.options.get("setup", "true")
        r = await self.box.exec(f"echo built-{self.name} > built && {setup}", timeout_s=3600)
        if r.exit_code != 0:
            raise RuntimeError(f"set-up failed: {r.stderr.decode()}")

    @tool(description="count once in the sandbox")
    async def bump(self) -> str:
        r = await self.box.exec("n=$(cat count 2>/dev/null || echo 0); echo $((n+1)) > count; cat count")
        return r.stdout.decode().strip()

    async def verify(self, task: dict[str, Any], response: Response) -> Verdict:
        r = await self.box.exec("cat built count 2>/dev/null")
        lines = r.stdout.decode().split()
        ok = lines == [f"built-{task['name']}", "1"]
        return Verdict(reward=1.0 if ok else 0.0, fields={"files": lines})

    async def snapshot(self) -> bytes | None:
        return self.name.encode()

    async def restore(self, data: bytes) -> None:
        self.name = data.decode()
        self.box = await self.sandbox()  # the template's fork, files and all
