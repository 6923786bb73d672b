"""The LLM test double for the verifiers tests: a deterministic policy for the vLLM emulator.

``say COLOR`` prompts: offered the ``get_color`` tool and not yet answered by it, the model
calls it; otherwise it answers the colour (``purple`` for green: a wrong answer), once more
per ``again`` the user said. Deterministic in the prompt, so verifiers' own runner and ours
get the same outputs whatever the order of calls.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tests.stub_openai import Gen, VLLMEmulator


def make_emulator() -> VLLMEmulator:
    em = VLLMEmulator()

    def text_of(body: dict[str, Any]) -> str:
        if "messages" in body:
            return json.dumps(body["messages"]) + json.dumps(body.get("tools"))
        p = body.get("prompt")
        return em.tokenizer.decode(p) if isinstance(p, list) else str(p)

    def policy(path: str, body: dict[str, Any]) -> Gen:
        s = text_of(body)
        sums = re.findall(r"Calculate ([-+*/ ()0-9]+)\.", s)
        if sums:  # reasoning_gym's basic_arithmetic: the right answer in its format
            return Gen(text=f"<answer>{int(eval(sums[-1]))}</answer>")  # digits and operators only
        color = re.findall(r"say (\w+)", s)[0]
        if "get_color" in s and "the colour is" not in s:
            return Gen(text=VLLMEmulator.tool_call_text("get_color", {"name": color}))
        if color == "green":
            return Gen(text="purple")
        return Gen(text=color + " ok" * s.count("again"))

    em.policy = policy
    return em
