"""A multi-turn tool environment with a known base rate: the tool draws one of 8 words, the reward is saying it.

``draw_word`` returns the row's ``word`` (one of ``WORDS``); ``verify`` gives 1.0 when the tool was called and
the last assistant message names the word, so a policy that calls the tool and then says a random word scores
1/8. Rows may ask for failures: ``explode: true`` makes every verify raise; ``explode_once: PATH`` makes the first
verify that finds no file at PATH raise (creating it), so a retry of that rollout succeeds; ``verify_delay_s``
holds each verify that long (after touching ``verifying``, a path, when given): a rollout in flight to kill its
agent under. Issue 66's: ``stall_s`` makes ``draw_word`` take that long (a policy that calls it runs its rollout's
``timeout_s`` out: a policy failure); ``fixed_reward`` is the reward whatever was said (a task the policy always gets
right, or never does); ``explode_rollout: N`` makes the verify of rollout N (``_ng_rollout_index``) raise;
``reward_given`` is returned as the reward (1e200: beyond any bound); ``rewards_by_rollout`` gives rollout N the
N-th reward of the list; ``forge_class`` makes ``draw_word`` raise a ``Failure`` of that class at once (an
environment forging its own failure: a ``timeout``, which only the rollout's clock may be). Issue 73's:
``forge_verify`` makes ``verify`` raise a ``Failure`` of that class (a verifier choosing who is blamed). Issue 78's:
``snapshot``/``restore`` keep the word and the draws (a rollout branched after its draw still scores).
"""

from __future__ import annotations

import json
import os
from typing import Any

import anyio

from gym_runtime.errors import Failure
from gym_runtime.messages import Message, Response
from gym_runtime.resource import Resource, Verdict, tool

WORDS = ["apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "forest"]


class SayWord(Resource):
    def __init__(self) -> None:
        self.forged: str | None = None
        self.word = ""
        self.drawn = 0
        self.stall_s = 0.0
        self.wait_s = 0.0

    async def seed(self, task: dict[str, Any]) -> None:
        self.forged = task.get("forge_class")  # draw_word raises a Failure of this class: a forged failure
        self.word = str(task.get("word", WORDS[0]))
        self.stall_s = float(task.get("stall_s", 0.0))
        self.wait_s = float(task.get("wait_s", 0.0))

    @tool
    async def draw_word(self) -> str:
        """Draw the word to say."""
        self.drawn += 1
        if self.forged:
            raise Failure(self.forged, "the rollout ran out of time (says the environment)")
        await anyio.sleep(self.stall_s)
        return f"say {self.word}"

    @tool
    async def wait(self) -> str:
        """Wait a while (the row's ``wait_s``: a policy that calls it may run its rollout's timeout_s out)."""
        await anyio.sleep(self.wait_s)
        return "waited"

    async def verify(self, task: dict[str, Any], response: Response) -> Verdict:
        if task.get("verifying"):
            open(task["verifying"], "a").close()
        await anyio.sleep(float(task.get("verify_delay_s", 0.0)))
        if task.get("forge_verify"):
            raise Failure(task["forge_verify"], "the answer ran out of time (says the verifier)")
        marker = task.get("explode_once")
        exploding = task.get("explode_rollout")
        if exploding is not None and task.get("_ng_rollout_index") == exploding:
            raise RuntimeError(f"this verifier fails rollout {exploding} on purpose")
        if "reward_given" in task:
            return Verdict(reward=float(task["reward_given"]))
        if "rewards_by_rollout" in task:
            return Verdict(reward=float(task["rewards_by_rollout"][task.get("_ng_rollout_index", 0)]))
        if "fixed_reward" in task:
            return Verdict(reward=float(task["fixed_reward"]))
        if task.get("explode") or (marker and not os.path.exists(marker)):
            if marker:
                open(marker, "w").close()
            raise RuntimeError("this verifier fails on purpose")
        said = ""
        for item in response.output:
            if isinstance(item, Message) and item.role == "assistant":
                content = item.content
                said = content if isinstance(content, str) else " ".join(str(p.get("text", "")) for p in content)
        said_it = self.drawn > 0 and self.word in said.split()  # drawn first: a guess scores 1/8 at best
        return Verdict(reward=float(said_it), fields={"said_word": float(said_it), "tool_calls": float(self.drawn)})

    async def snapshot(self) -> bytes | None:
        return json.dumps({"word": self.word, "drawn": self.drawn}).encode()

    async def restore(self, data: bytes) -> None:
        state = json.loads(data)
        self.word, self.drawn = str(state["word"]), int(state["drawn"])
