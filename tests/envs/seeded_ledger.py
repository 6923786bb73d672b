"""A stateful environment of plain Python that can be set up once for its group (``seed_once``: issue 78 item 2).

Its ``seed`` is the set-up (noted in the ``seeds`` file of its options, one line per seed, for a test to count);
its state is a ledger of the task's ``n`` items and those taken. ``take`` takes the next one; ``verify`` rewards
a session in which exactly the first item was taken: a repeat that saw another repeat's take (state shared, not
copied) scores 0. ``snapshot``/``restore`` carry the whole state, so a fresh session needs no seed to be restored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gym_runtime.messages import Response
from gym_runtime.resource import Resource, Verdict, tool


def task(name: str, n: int = 3) -> dict[str, Any]:
    """A task offering ``take`` (the scripted policy calls it once, then answers)."""
    return {
        "responses_create_params": {
            "input": [{"role": "user", "content": f"take one item of {name}"}],
            "tools": [{"type": "function", "name": "take", "parameters": {"type": "object", "properties": {}}}],
        },
        "name": name,
        "n": n,
    }


def note_seed(options: dict[str, Any], name: str) -> None:
    seeds = options.get("seeds")
    if seeds:
        with Path(seeds).open("a") as f:
            f.write(f"{name}\n")


class SeededLedger(Resource):
    async def seed(self, task: dict[str, Any]) -> None:
        note_seed(self.options, task["name"])
        self.items = [f"{task['name']}-{i}" for i in range(int(task["n"]))]
        self.taken: list[str] = []

    @tool(description="take the next item")
    async def take(self) -> dict[str, Any]:
        item = self.items[len(self.taken)]
        self.taken.append(item)
        return {"item": item, "taken": len(self.taken)}

    async def verify(self, task: dict[str, Any], response: Response) -> Verdict:
        ok = self.taken == [f"{task['name']}-0"]
        return Verdict(reward=1.0 if ok else 0.0, fields={"taken": self.taken})

    async def snapshot(self) -> bytes | None:
        return json.dumps({"items": self.items, "taken": self.taken}).encode()

    async def restore(self, data: bytes) -> None:
        state = json.loads(data)
        self.items, self.taken = state["items"], state["taken"]
