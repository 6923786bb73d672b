"""verifiers environments written against verifiers' public API (0.3.x), for tests/e2e/test_verifiers.py.

``vf.load_environment("tests.envs.vf_suite", kind=...)`` picks one: ``single`` (a
single-turn env with a rubric), ``tool`` (a ToolEnv), ``multi`` (a MultiTurnEnv whose
user answers twice), ``group`` (a rubric with a group reward function), ``raises`` /
``multi_raises`` / ``not_number`` / ``hangs`` (a reward function that fails in that way), ``setup_raises``,
``columns`` (a reward function that takes a dataset column by name), ``env_group`` (an EnvGroup of
three children with their own rubrics, one of whose reward function raises), ``gil_hog`` (a reward function
that runs a grader's kind of regex over the model's answer: quadratic on repeated ``\\(``, and Python's ``re``
never releases the GIL while it searches, so a long hostile answer holds its process for minutes).
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import verifiers as vf
from datasets import Dataset

ROWS = [
    {"question": "say blue", "answer": "blue"},
    {"question": "say red", "answer": "red"},
    {"question": "say green", "answer": "green"},
]


def _dataset() -> Dataset:
    return Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r["question"]}], "answer": r["answer"]} for r in ROWS]
    )


def _text(completion: Any) -> str:
    out = []
    for m in completion:
        if (m["role"] if isinstance(m, dict) else getattr(m, "role", "")) == "tool":
            continue  # what the model said, not what the tool answered
        content = m["content"] if isinstance(m, dict) else getattr(m, "content", "")
        if isinstance(content, str):
            out.append(content)
    return " ".join(out)


def exact(completion: Any, answer: str, **kwargs: Any) -> float:
    return 1.0 if answer in _text(completion).lower() else 0.0


def length_penalty(completion: Any, **kwargs: Any) -> float:
    return -0.01 * len(_text(completion))


def get_color(name: str) -> str:
    """Look up the colour with this name."""
    return f"the colour is {name}"


class TwoQuestions(vf.MultiTurnEnv):
    """The user asks twice more; each reply is scored in the rubric."""

    async def env_response(self, messages: Any, state: Any, **kwargs: Any) -> Any:
        turns = sum(1 for m in messages if (m["role"] if isinstance(m, dict) else m.role) == "assistant")
        state["asked"] = turns
        return [{"role": "user", "content": f"again {turns}"}]

    @vf.stop
    async def asked_twice(self, state: Any) -> bool:
        return len(state["trajectory"]) >= 3


class SetupRaises(vf.SingleTurnEnv):
    async def setup_state(self, state: Any) -> Any:
        raise RuntimeError("setup broke")


def weighted(completion: Any, answer: str, difficulty: int) -> float:
    """Takes the dataset's own ``difficulty`` column by name, as verifiers passes every column."""
    return float(difficulty) if answer in _text(completion).lower() else 0.0


def _columns_dataset() -> Dataset:
    return Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": r["question"]}], "answer": r["answer"], "difficulty": i + 1}
            for i, r in enumerate(ROWS)
        ]
    )


# a \( ... \) span, lazily (NeMo Gym's imo_proofbench_judge kind of grader): on "\(" repeated it tries
# every start and scans to the end from each
SPAN = re.compile(r"\\\((.*?)\\\)", re.S)


def graded(completion: Any, **kwargs: Any) -> float:
    """1.0 for any answer, once its \\( ... \\) spans are found (a long run of \\( holds the GIL quadratically)."""
    SPAN.findall(_text(completion))
    return 1.0


def broken(completion: Any, **kwargs: Any) -> float:
    raise ValueError("reward blew up")


def load_environment(kind: str = "single") -> vf.Environment:
    if kind == "single":
        rubric = vf.Rubric(funcs=[exact, length_penalty], weights=[1.0, 0.5])
        return vf.SingleTurnEnv(dataset=_dataset(), rubric=rubric)
    if kind == "tool":
        return vf.ToolEnv(dataset=_dataset(), tools=[get_color], rubric=vf.Rubric(funcs=[exact]), max_turns=4)
    if kind == "multi":
        return TwoQuestions(dataset=_dataset(), rubric=vf.Rubric(funcs=[exact, length_penalty]), max_turns=5)
    if kind == "group":

        def rank_in_group(completions: list[Any], **kwargs: Any) -> list[float]:
            """1.0 for the longest completion of the group, 0.0 for the others; the group size as a metric."""
            lengths = [len(_text(c)) for c in completions]
            best = max(lengths)
            return [1.0 + len(completions) / 100 if n == best else len(completions) / 100 for n in lengths]

        return vf.SingleTurnEnv(dataset=_dataset(), rubric=vf.Rubric(funcs=[exact, rank_in_group]))
    if kind == "raises":
        return vf.SingleTurnEnv(dataset=_dataset(), rubric=vf.Rubric(funcs=[broken]))
    if kind == "multi_raises":  # three model turns, then a reward function that raises
        return TwoQuestions(dataset=_dataset(), rubric=vf.Rubric(funcs=[broken]), max_turns=5)
    if kind == "not_number":

        def words(completion: Any, **kwargs: Any) -> Any:
            return "high"

        return vf.SingleTurnEnv(dataset=_dataset(), rubric=vf.Rubric(funcs=[words]))
    if kind == "hangs":

        async def slow(completion: Any, **kwargs: Any) -> float:
            if "blue" in _text(completion):
                await asyncio.sleep(3600)
            return 1.0

        return vf.SingleTurnEnv(dataset=_dataset(), rubric=vf.Rubric(funcs=[slow]))
    if kind == "gil_hog":
        return vf.SingleTurnEnv(dataset=_dataset(), rubric=vf.Rubric(funcs=[graded]))
    if kind == "reasoning_gym":  # an environment class that ships inside the verifiers wheel
        return vf.ReasoningGymEnv(gym="basic_arithmetic", num_train_examples=4, num_eval_examples=2, seed=7)
    if kind == "setup_raises":
        return SetupRaises(dataset=_dataset(), rubric=vf.Rubric(funcs=[exact]))
    if kind == "columns":
        return vf.SingleTurnEnv(dataset=_columns_dataset(), rubric=vf.Rubric(funcs=[weighted]))
    if kind == "env_group":
        children = [
            vf.SingleTurnEnv(dataset=_dataset(), rubric=vf.Rubric(funcs=[exact])),
            vf.SingleTurnEnv(dataset=_dataset(), rubric=vf.Rubric(funcs=[length_penalty])),
            vf.SingleTurnEnv(dataset=_dataset(), rubric=vf.Rubric(funcs=[broken])),
        ]
        return vf.EnvGroup(envs=children, env_names=["exact_env", "short_env", "broken_env"])
    raise ValueError(f"unknown kind {kind!r}")
