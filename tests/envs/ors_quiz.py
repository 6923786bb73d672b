"""Small ORS environments written as the openreward SDK's ``orwd init`` template writes one, for
tests/e2e/test_openreward.py: single-step ones.

``Quiz``: one tool, ``answer``; 1.0 for the task's solution, else 0.0, and the answer ends the episode.
A task with ``explode`` makes the tool raise. ``Oral``: no tool the model calls; its ``@terminal`` ``submit``
takes the model's plain answer (1.0 when it is the solution).
"""

import sys

from openreward.environments import Environment, JSONObject, Server, TextBlock, ToolOutput, terminal, tool
from pydantic import BaseModel


class QuizTaskSpec(BaseModel):
    id: str
    problem: str
    solution: str
    explode: bool = False


class AnswerParams(BaseModel):
    answer: str


QUIZ_TASKS = [
    {"id": "q0", "problem": "Say the word: example", "solution": "example"},
    {"id": "q1", "problem": "What is 2+2?", "solution": "4"},
    {"id": "q2", "problem": "Say the word: example", "solution": "example"},
]


class Quiz(Environment):
    """One question, one answer."""

    def __init__(self, task_spec: JSONObject = {}, secrets: dict[str, str] = {}):  # noqa: B006 - the SDK template
        super().__init__(task_spec)
        self.config = QuizTaskSpec.model_validate(task_spec)

    @classmethod
    def list_tasks(cls, split: str) -> list[JSONObject]:
        if split == "train":
            return QUIZ_TASKS
        raise ValueError(f"Unknown split: {split}")

    @classmethod
    def list_splits(cls) -> list[str]:
        return ["train"]

    def get_prompt(self) -> list[TextBlock]:
        return [TextBlock(type="text", text=self.config.problem)]

    @tool
    async def answer(self, params: AnswerParams) -> ToolOutput:
        """Submit your final answer. This finishes the episode."""
        if self.config.explode:
            raise RuntimeError("grader exploded")
        correct = params.answer == self.config.solution
        return ToolOutput(
            blocks=[TextBlock(type="text", text="Correct!" if correct else "Wrong!")],
            reward=1.0 if correct else 0.0,
            finished=True,
        )


class Oral(Environment):
    """Answered in plain text: the @terminal tool grades the model's last message."""

    def __init__(self, task_spec: JSONObject = {}, secrets: dict[str, str] = {}):  # noqa: B006 - the SDK template
        super().__init__(task_spec)
        self.config = QuizTaskSpec.model_validate(task_spec)

    @classmethod
    def list_tasks(cls, split: str) -> list[JSONObject]:
        return [
            {"id": "o0", "problem": "Say OK", "solution": "OK"},
            {"id": "o1", "problem": "Say no", "solution": "no"},
        ]

    @classmethod
    def list_splits(cls) -> list[str]:
        return ["train"]

    def get_prompt(self) -> list[TextBlock]:
        return [TextBlock(type="text", text=self.config.problem)]

    @terminal
    @tool
    async def submit(self, params: AnswerParams) -> ToolOutput:
        """Your answer."""
        correct = params.answer.strip() == self.config.solution
        return ToolOutput(blocks=[TextBlock(text="graded")], reward=1.0 if correct else 0.0, finished=True)


if __name__ == "__main__":
    Server([Quiz, Oral]).run(host="127.0.0.1", port=int(sys.argv[1]))
