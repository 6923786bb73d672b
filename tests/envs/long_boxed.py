"""A long multi-turn environment in a sandbox of the fleet (tests/e2e/test_resume.py, tests/bench/resume.py).

It offers ``STEPS`` tools, ``step_00`` ... (a task offers them all with ``parallel_tool_calls: false``, so the
scripted policy, a TEST DOUBLE for the LLM, calls one a turn: a rollout of ``STEPS`` + 1 model turns). Each
bumps a counter file of its own in the session's one container and answers the container's name and the count:
a side effect run twice counts 2. ``verify`` reads every counter back from the container.

Options: ``restorable`` (``snapshot``/``restore``: the counts, written into a restored session's new container;
``"files"``: the counts only, the files left to the container the restored session holds: a branch's fork of the
copy kept at its turn, tests/e2e/test_branch_boxes.py),
``slow_step``/``slow_s``/``marker`` (that step sleeps ``slow_s`` in its container after touching ``marker`` on
this host: a test kills the agent while the call runs).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gym_runtime.messages import Response
from gym_runtime.resource import Resource, Verdict, tool

STEPS = 50


def step_name(i: int) -> str:
    return f"step_{i:02d}"


def task(steps: int = STEPS, **fields: Any) -> dict[str, Any]:
    """A task offering ``steps`` of the tools, one a turn."""
    tools = [
        {"type": "function", "name": step_name(i), "parameters": {"type": "object", "properties": {}}}
        for i in range(steps)
    ]
    return {
        "responses_create_params": {
            "input": [{"role": "user", "content": "run every step"}],
            "tools": tools,
            "parallel_tool_calls": False,
        },
        **fields,
    }


class LongBoxed(Resource):
    async def seed(self, task: dict[str, Any]) -> None:
        self.counts: dict[str, int] = {}
        self.box: Any = None

    async def _box(self) -> Any:
        if self.box is None:
            self.box = await self.sandbox()
        return self.box

    async def step(self, name: str) -> dict[str, Any]:
        box = await self._box()
        opts = self.options
        if opts.get("slow_step") is not None and name == step_name(int(opts["slow_step"])):
            Path(opts["marker"]).write_text(name)  # the call is running: the test may kill its agent now
            await box.exec(f"sleep {float(opts.get('slow_s', 3))}", timeout_s=60)
        r = await box.exec(f"n=$(cat {name} 2>/dev/null || echo 0); echo $((n+1)) > {name}; hostname; cat {name}")
        host, count = r.stdout.decode().split()
        self.counts[name] = int(count)
        return {"container": host, "sandbox": box.id, "count": int(count)}

    async def verify(self, task: dict[str, Any], response: Response) -> Verdict:
        box = await self._box()
        r = await box.exec("hostname; for f in step_*; do [ -f $f ] && echo $f $(cat $f); done")
        lines = r.stdout.decode().split("\n")
        counts = {k: int(v) for k, v in (line.split() for line in lines[1:] if line.strip())}
        return Verdict(reward=1.0, fields={"counts": counts, "container": lines[0], "sandbox": box.id})

    async def snapshot(self) -> bytes | None:
        return json.dumps(self.counts).encode() if self.options.get("restorable") else None

    async def restore(self, data: bytes) -> None:
        if not self.options.get("restorable"):
            raise NotImplementedError("not restorable")
        self.counts = json.loads(data)
        box = await self._box()
        if self.options["restorable"] == "files":  # its files are the sandbox's it was handed
            return
        for name, n in self.counts.items():  # the state it had, in its new container (not a tool's side effect)
            await box.write(name, f"{n}\n")


def _step_tool(i: int) -> Any:
    name = step_name(i)

    async def step(self: LongBoxed) -> dict[str, Any]:
        return await self.step(name)

    step.__name__ = name
    return tool(step, name=name, description=f"step {i}")


# the class the workers serve: LongBoxed with its STEPS tools
resource = type(
    "LongBoxedSteps",
    (LongBoxed,),
    {"__module__": __name__, **{step_name(i): _step_tool(i) for i in range(STEPS)}},
)
